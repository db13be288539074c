"""``λ_max`` by trace-normalised squaring (Sign-Muon's ``‖S‖₂`` off the CPU) against an SVD.

The reference is ``torch.linalg.matrix_norm(·, ord=2)`` in float64 (an SVD); the
squaring uses matrix products only. The bracket ``L_k ≤ λ_max ≤ U_k`` it stops on
holds for any spectrum, so the cases are the ones a power iteration fails on: ±1
sign matrices (no spectral gap) and an exactly repeated top singular value.
"""

import pytest
import torch

from dmuon.optim.transforms import normalization
from dmuon.optim.transforms.normalization import inverse_spectral_norm, lambda_max_by_squaring


def spectral_norm(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(X.double(), ord=2).reshape(-1)


def signs(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.sign(torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("shape", [(3, 40, 96), (3, 96, 40)], ids=["wide", "tall"])
def test_sign_matrices_float32(shape):
    X = signs(*shape)
    got = 1 / inverse_spectral_norm(X, "squaring").reshape(-1).double()
    # It stops when U_k ≤ L_k(1 + 64ε₃₂): λ to 7.6e-6, σ = √λ to 3.8e-6, plus fp32 rounding.
    torch.testing.assert_close(got, spectral_norm(X), rtol=1e-5, atol=0)


def test_sign_matrices_float64_to_rounding():
    X = signs(4, 7, 12, dtype=torch.float64)
    X[1] = 0
    inv = inverse_spectral_norm(X, "squaring").reshape(-1)
    assert inv[1] == 0  # a zero matrix stays zero
    keep = [0, 2, 3]
    torch.testing.assert_close(1 / inv[keep], spectral_norm(X)[keep], rtol=1e-12, atol=0)


def test_repeated_top_singular_value_no_gap():
    # σ = (2, 2, 2, 1, 0.5): the top one three times. U_k/L_k → 3^{1/p}, so it takes
    # p ≈ ln 3/(64ε) squarings' worth; still certified at the end.
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(9, 5, generator=g, dtype=torch.float64))
    X = (U @ torch.diag(torch.tensor([2.0, 2, 2, 1, 0.5], dtype=torch.float64)) @ V.T)[None]
    lam = lambda_max_by_squaring(X @ X.mT)
    assert abs(lam.item() - 4.0) < 1e-12


def test_bfloat16_input():
    X = signs(2, 32, 80, dtype=torch.bfloat16)
    inv = inverse_spectral_norm(X, "squaring")
    assert inv.dtype == torch.bfloat16
    # fp32 inside, one rounding of the result to bf16 (2^-8 relative).
    torch.testing.assert_close(1 / inv.reshape(-1).double(), spectral_norm(X), rtol=4e-3, atol=0)


def test_no_overflow_for_huge_entries():
    # Entries of 1e30: X Xᵀ would be 1e60·n in fp32 (inf) without the power-of-two shift.
    X = 1e30 * signs(1, 16, 48)
    got = 1 / inverse_spectral_norm(X, "squaring").reshape(-1).double()
    torch.testing.assert_close(got, spectral_norm(X), rtol=1e-5, atol=0)


def test_a_nan_matrix_gives_nan_and_does_not_hold_back_the_others():
    X = signs(2, 8, 20)
    X[0, 1, 2] = float("nan")
    G = X @ X.mT
    lam = lambda_max_by_squaring(G, max_squarings=64)
    assert torch.isnan(lam[0]).all()
    sigma = lam[1].double().sqrt().reshape(-1)
    torch.testing.assert_close(sigma, spectral_norm(X[1:]), rtol=1e-5, atol=0)


def test_both_methods_agree_and_auto_uses_eigvalsh_on_the_cpu():
    X = signs(2, 24, 64)
    a = inverse_spectral_norm(X, "squaring")
    b = inverse_spectral_norm(X, "eigvalsh")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    assert normalization.LAMBDA_MAX_METHOD["cpu"] == "eigvalsh"
    assert torch.equal(inverse_spectral_norm(X), b)


def test_bad_method():
    with pytest.raises(ValueError, match=r"method must be 'auto' or one of .* got 'power'"):
        inverse_spectral_norm(torch.ones(1, 2, 2), "power")


def test_convergence_is_asked_once_per_squarings_per_check(monkeypatch):
    """Each convergence check reads a flag on the host (a GPU synchronisation): asked every
    ``SQUARINGS_PER_CHECK`` squarings, not after each, with the same accuracy."""
    X = signs(3, 40, 96)
    G = X @ X.mT
    squarings, checks = [0], [0]
    matmul, to_bool = torch.Tensor.__matmul__, torch.Tensor.__bool__

    def counted_matmul(a, b):
        squarings[0] += 1
        return matmul(a, b)

    def counted_bool(t):
        checks[0] += 1
        return to_bool(t)

    monkeypatch.setattr(torch.Tensor, "__matmul__", counted_matmul)
    monkeypatch.setattr(torch.Tensor, "__bool__", counted_bool)
    got = lambda_max_by_squaring(G).reshape(-1).double()
    monkeypatch.undo()
    per = normalization.SQUARINGS_PER_CHECK
    assert squarings[0] >= 2 * per, squarings  # enough squarings for the count to tell
    assert checks[0] == squarings[0] // per + 1, (checks, squarings)
    torch.testing.assert_close(got, spectral_norm(X) ** 2, rtol=2e-5, atol=0)
