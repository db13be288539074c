"""The hard clip computed on the m × m side, ``τ·max(MMᵀ, τ²I)^{-1/2}·M``, against an SVD.

The reference clips the singular values of a float64 SVD of the input; the kernel
never factorises. Each test is one input class the optimizer meets: bf16 momentum,
tall matrices, batches, a zero matrix, singular values at and near τ, and a wide
spread (σ_max²/τ² = 1e6, the inverse square root's slowest case).
"""

import pytest
import torch
from nsref import matrix_with_singular_values, rel_err

from dmuon.kernels import spectral_clip


def svd_clip(M: torch.Tensor, tau: float) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(M.double(), full_matrices=False)
    return U @ torch.diag_embed(S.clamp(max=tau)) @ Vh


def spread(k: int, hi: float = 8.0, lo: float = 0.05) -> torch.Tensor:
    return torch.logspace(torch.log10(torch.tensor(hi)), torch.log10(torch.tensor(lo)), k)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16)], ids=str)
def test_float64_wide_and_tall(shape):
    M = matrix_with_singular_values(*shape, spread(16), seed=1)
    out = spectral_clip(M, 1.0, compute_dtype=torch.float64)
    # No σ within 2% of τ here: the sign is exact to ~1e-12 and B^{-1/2} to 1e-15.
    assert rel_err(out, svd_clip(M, 1.0)) < 1e-9


def test_batch_equals_each_matrix():
    M = torch.stack([matrix_with_singular_values(12, 30, spread(12), seed=s) for s in range(3)])
    batched = spectral_clip(M, 0.7, compute_dtype=torch.float64)
    for b in range(3):
        single = spectral_clip(M[b], 0.7, compute_dtype=torch.float64)
        # Same products per matrix; the inner step count comes from the batch's largest
        # bound, and extra steps of a converged iteration change nothing above 1e-13.
        torch.testing.assert_close(batched[b], single, rtol=1e-12, atol=1e-13)
        assert rel_err(batched[b], svd_clip(M[b], 0.7)) < 1e-9


def test_bfloat16_input_runs_in_float32():
    M = matrix_with_singular_values(32, 64, spread(32), seed=2).to(torch.bfloat16)
    out = spectral_clip(M, 1.0)
    assert out.dtype == torch.bfloat16
    # The reference clips the bf16 matrix itself (rounded once); fp32 iterations on it,
    # then one rounding to bf16 (2^-8 relative per entry).
    assert rel_err(out, svd_clip(M.double(), 1.0)) < 1e-2


def test_float32_wide_spread():
    # σ from 31.6 down to 0.0316 (none within 15% of τ): κ(B) ≈ σ_max²/τ² = 1e3, the
    # inverse square root's ⌈log_2.25 κ⌉ + 6 ≈ 16 steps. (The sign resolves σ² − τ²
    # down to ~1e-4·‖MMᵀ − τ²I‖_F, 0.1 here; see spectral_clip's Accuracy.)
    M = matrix_with_singular_values(20, 40, torch.logspace(1.5, -1.5, 20), seed=3)
    out = spectral_clip(M.float(), 1.0)
    # fp32 products over a 1e6 range of eigenvalues of A: measured 6e-6.
    assert rel_err(out, svd_clip(M, 1.0)) < 1e-4
    assert torch.linalg.svdvals(out.double()).max() < 1.0 + 1e-4


def test_zero_matrix_stays_zero():
    out = spectral_clip(torch.zeros(2, 5, 9), 1.0)
    assert torch.equal(out, torch.zeros(2, 5, 9))


def test_singular_values_close_to_tau_land_between_sigma_and_tau():
    # σ = τ(1 ± 1e-5): inside the band where the sign of σ² − τ² is not resolved after
    # 12 steps. The documented behaviour: the clipped value lies between σ and τ.
    tau = 1.0
    sv = torch.tensor([3.0, 1.0 + 1e-5, 1.0, 1.0 - 1e-5, 0.2], dtype=torch.float64)
    M = matrix_with_singular_values(5, 11, sv, seed=4)
    out = spectral_clip(M, tau, compute_dtype=torch.float64)
    got = torch.linalg.svdvals(out)
    want = sv.clamp(max=tau)
    # Each clipped value lies between its σ and τ, so within |σ − τ| ≤ 1e-5 of the
    # exact clip (svdvals sorts, and the three values near τ may change places).
    assert (got - want).abs().max() < 1.1e-5
    assert got.max() <= 1.0 + 1e-5 + 1e-12
    # the resolved small one (0.2) passes through exactly
    assert abs(got[-1] - 0.2) < 1e-9
