"""NuMuon's top-k factor without the SVD of a wide matrix (fp32/bf16), against an SVD.

For fp32 and bf16 input :class:`TopKPolar` finishes with the float64
eigendecomposition of the small ``l × l`` Gram matrix of ``B = QᵀA`` instead of an
SVD of ``B``; the reference is ``U_k V_kᵀ`` from a float64 SVD of the input. With a
gap after σ_k (or ``k + oversample ≥ min(m, n)``) the range finder is exact, so what
is left is the small factorisation's accuracy and fp32 rounding.
"""

import pytest
import torch
from spectra import with_singular_values

from dmuon.optim.transforms import StepContext, TopKPolar, sketch_matrix


def top_k(X, k):
    U, S, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    keep = (S[..., :k] > 0).double()
    return U[..., :, :k] @ (Vh[..., :k, :] * keep.unsqueeze(-1))


def hp(rank_fraction, oversample=4, power_iters=2, seed=0):
    return dict(
        rank_fraction=rank_fraction,
        rank_schedule="constant",
        power_iters=power_iters,
        oversample=oversample,
        seed=seed,
    )


def run(X, h, step=1):
    return TopKPolar()(X, {}, StepContext(grad=X, hp=h, step=step))


# σ = 10, 9, 8, 7 then ≤ 0.5: a gap of 14 after k = 4; with q = 2 power steps the
# range finder's error is (0.5/7)^5 ≈ 2e-6 of the top-4 subspace.
GAPPED = [10.0, 9.0, 8.0, 7.0] + [0.5 / (i + 1) for i in range(16)]


@pytest.mark.parametrize("shape", [(20, 48), (48, 20)], ids=["wide", "tall"])
def test_float32_matches_the_svd(shape):
    X = with_singular_values(*shape, GAPPED, seed=1)
    out = run(X.float()[None], hp(4 / 20))[0]
    assert out.dtype == torch.float32
    # (0.5/7)^5 from the range finder plus fp32 rounding
    assert (out.double() - top_k(X, 4)).abs().max() < 1e-4


def test_full_rank_is_the_polar_factor_in_float32():
    X = torch.randn(3, 12, 30, generator=torch.Generator().manual_seed(2))
    out = run(X, hp(1.0))
    # k + oversample ≥ min(m, n): exact range; κ(X) ≈ 6, fp32 products.
    assert (out.double() - top_k(X, 12)).abs().max() < 1e-5


def test_bfloat16_input():
    X = with_singular_values(16, 40, GAPPED[:16], seed=3).to(torch.bfloat16)
    out = run(X[None], hp(4 / 16))[0]
    assert out.dtype == torch.bfloat16
    # computed in fp32 from the bf16 matrix, rounded once to bf16 (2^-8 of entries ≤ 1)
    assert (out.double() - top_k(X.double(), 4)).abs().max() < 1e-2


def test_batch_equals_each_matrix():
    X = torch.stack([with_singular_values(20, 36, GAPPED, seed=s).float() for s in range(3)])
    batched = run(X, hp(0.2), step=5)
    for b in range(3):
        # the sketch depends on (seed, step, n, width) only, not on the batch
        torch.testing.assert_close(batched[b], run(X[b : b + 1], hp(0.2), step=5)[0])


def test_zero_and_rank_deficient_matrices():
    X = torch.zeros(2, 10, 24)
    X[1] = with_singular_values(10, 24, [3.0, 2.0] + [0.0] * 8, seed=4).float()
    out = run(X, hp(0.5))  # k = 5 > rank 2: the zero directions are dropped
    assert torch.equal(out[0], torch.zeros(10, 24))
    assert (out[1].double() - top_k(X[1], 2)).abs().max() < 1e-5
    assert torch.isfinite(out).all()


def test_sketch_is_drawn_on_the_requested_device_and_dtype():
    a = sketch_matrix(30, 6, seed=1, step=7, device="cpu", dtype=torch.float32)
    b = sketch_matrix(30, 6, seed=1, step=7, device="cpu", dtype=torch.float32)
    assert a.dtype == torch.float32 and a.device.type == "cpu"
    assert torch.equal(a, b)  # a restored step replays the same sketch
    assert not torch.equal(a, sketch_matrix(30, 6, seed=1, step=8, dtype=torch.float32))
    assert not torch.equal(a, sketch_matrix(30, 7, seed=1, step=7, dtype=torch.float32)[:, :6])
