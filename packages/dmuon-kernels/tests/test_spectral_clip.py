import pytest
import torch
from nsref import matrix_with_singular_values, rel_err

from dmuon.kernels import spectral_clip


def svd_reference(M, fn):
    U, S, Vh = torch.linalg.svd(M.double(), full_matrices=False)
    return U @ torch.diag_embed(fn(S)) @ Vh


@pytest.mark.parametrize("shape", [(24, 24), (16, 40), (40, 16)], ids=str)
@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
def test_hard_clip_matches_svd(shape, tau):
    m, n = shape
    k = min(m, n)
    # Singular values spread over [0.05, 8] but not within 2% of tau, where the
    # sign of σ² − τ² is ill-conditioned (documented).
    sv = torch.logspace(torch.log10(torch.tensor(8.0)), torch.log10(torch.tensor(0.05)), k)
    sv = torch.where((sv - tau).abs() < 0.02 * tau, sv * 1.05, sv)
    M = matrix_with_singular_values(m, n, sv, seed=k)
    out = spectral_clip(M, tau, compute_dtype=torch.float64)
    ref = svd_reference(M, lambda s: s.clamp(max=tau))
    assert rel_err(out, ref) < 1e-6
    assert torch.linalg.svdvals(out).max() <= tau * (1 + 1e-6)


def test_hard_clip_float32_and_batch():
    M = torch.randn(3, 20, 50, generator=torch.Generator().manual_seed(0)) * 0.5
    out = spectral_clip(M, 1.0)
    ref = svd_reference(M, lambda s: s.clamp(max=1.0))
    # fp32 inner iterations: 12 Newton–Schulz steps of products, ~1e-4 relative.
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-3


def test_matrices_inside_the_ball_are_unchanged():
    M = matrix_with_singular_values(12, 30, torch.linspace(0.9, 0.01, 12))
    torch.testing.assert_close(
        spectral_clip(M, 1.0, compute_dtype=torch.float64), M, rtol=1e-7, atol=1e-9
    )


@pytest.mark.parametrize("tau", [0.5, 2.0])
def test_soft_clip_matches_svd(tau):
    M = matrix_with_singular_values(20, 36, torch.logspace(1, -2, 20), seed=4)
    out = spectral_clip(M, tau, mode="soft", compute_dtype=torch.float64)
    ref = svd_reference(M, lambda s: s / torch.sqrt(1 + (s / tau) ** 2))
    assert rel_err(out, ref) < 1e-8


def test_zero_and_empty():
    assert not spectral_clip(torch.zeros(4, 6)).any()
    assert spectral_clip(torch.zeros(0, 6)).shape == (0, 6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": 0.0}, "tau must be > 0, got 0.0"),
        ({"tau": -1}, "tau must be > 0"),
        ({"mode": "medium"}, "mode must be 'hard' or 'soft', got 'medium'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        spectral_clip(torch.randn(3, 4), **kwargs)


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_an_infinite_tau_clips_nothing(mode):
    """``tau=inf``: every singular value is below it; the input comes back (it raised)."""
    M = torch.randn(6, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = spectral_clip(M, float("inf"), mode=mode)
    assert torch.equal(out, M) and out is not M


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("scale", [1e20, 1e-25, 1e-40])
def test_the_scale_of_m_and_tau_is_free_in_float32(mode, scale):
    """Clipping is homogeneous: ``clip_{cτ}(cM) = c clip_τ(M)``. In fp32, entries of 1e20
    (``M Mᵀ`` overflows), 1e-25 (``τ²`` underflows) and 1e-40 (subnormal) clip as at scale
    1 (compared with the SVD of the fp32 input as given: subnormals keep fewer bits).
    Before: OverflowError, ``ValueError: cannot convert float NaN to integer``, or NaN."""
    g = torch.Generator().manual_seed(0)
    M = torch.randn(2, 16, 40, dtype=torch.float64, generator=g) * torch.tensor([[[1.0]], [[0.5]]])
    tau = 4.0
    fn = (
        (lambda s: s.clamp(max=tau))
        if mode == "hard"
        else lambda s: s / (1 + (s / tau) ** 2).sqrt()
    )
    given = (M * scale).float()
    ref = svd_reference(given.double() / scale, fn)
    out = spectral_clip(given, tau * scale, mode=mode)
    assert torch.isfinite(out).all()
    assert rel_err(out.double() / scale, ref) < 1e-5


def test_a_ratio_beyond_the_compute_dtype_is_named():
    """σ_max/τ ≈ 1e21 in fp32: ``σ²/τ²`` is not representable; the error says so and names
    the way out (it was ``OverflowError: cannot convert float infinity to integer``)."""
    M = torch.randn(16, 40, generator=torch.Generator().manual_seed(0)) * 1e20
    with pytest.raises(
        ValueError, match=r"beyond torch.float32's range.*compute_dtype=torch.float64"
    ):
        spectral_clip(M, 1.0)
    assert torch.isfinite(spectral_clip(M.double(), 1.0, compute_dtype=torch.float64)).all()
