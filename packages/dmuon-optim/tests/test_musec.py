"""Musec's clip convention (issue 17), against a float64 SVD.

The momentum is brought to Muon's Frobenius norm divided by τ, ``B = √min(m, n)·U/(τ‖U‖_F)``,
and its singular values are clipped at one: hard ``min(σ, 1)``, soft ``σ/√(1 + σ²)`` —
the clip at τ of the momentum at Muon's norm, scaled by 1/τ.
The reference here computes B's singular values from the SVD of the input, not
with the optimizer's Newton–Schulz-type iterations.
"""

import math

import pytest
import torch
from spectra import with_singular_values

from dmuon.optim import DMuon, get_rule

HP = dict(
    momentum=0.95,
    nesterov=True,
    adjust_lr="match_rms_adamw",
    ns_method="gram",
    ns_coefficients="polar_express",
    ns_steps=5,
    ns_compute_dtype=None,
)


def documented_clip(sv: torch.Tensor, k: int, tau: float, mode: str) -> torch.Tensor:
    """The page's convention, from singular values: normalise, clip at τ, scale by 1/τ."""
    s = sv * (math.sqrt(k) / sv.norm())
    clipped = s.clamp(max=tau) if mode == "hard" else s / torch.sqrt(1 + (s / tau) ** 2)
    return clipped / tau


# Singular values from 1e-4 to 1e2 "in gradient units": the old convention (clip the
# momentum itself at τ = 1) clipped only the top two of them and left a step of the
# gradient's size, which the new one does not depend on (the 1e-3 scale below).
WIDE = torch.logspace(-4, 2, 8, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("tau", [1.0, 0.5])
@pytest.mark.parametrize(("m", "n"), [(8, 24), (24, 8)])
def test_update_singular_values_follow_the_documented_clip(mode, tau, m, n):
    G = with_singular_values(m, n, WIDE)
    rule = get_rule("musec")
    hp = HP | {k: o.default for k, o in rule.options.items()} | {"clip_mode": mode, "clip_tau": tau}
    state = {"momentum_buffer": torch.zeros(1, m, n, dtype=torch.float64)}
    U, scale = rule.update(1e-3 * G[None], state, hp)
    got = torch.linalg.svdvals(U[0])
    # Nesterov on a zero buffer: G + μ(μ·0 + G) = (1 + μ)G, a scale the norm removes.
    want = documented_clip(WIDE.flip(0), min(m, n), tau, mode)
    # float64 iterations; the hard clip resolves a σ to ~1e-10 unless it lies within
    # ~1e-4·‖BBᵀ − τ²I‖_F of τ (none here), the soft one converges in 30 steps.
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    assert scale == pytest.approx(0.2 * math.sqrt(max(m, n)))


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_clip_engages_at_default_tau(mode):
    """At the default τ (0.1 of the RMS singular value) the strong directions become
    one — Muon's step — and the weakest keeps its relative size, whatever the
    gradient's scale."""
    sv = torch.tensor([3.0, 2.0, 0.5, 0.1], dtype=torch.float64)
    G = with_singular_values(4, 16, sv)
    rule = get_rule("musec")
    hp = HP | {k: o.default for k, o in rule.options.items()} | {"clip_mode": mode}
    out = []
    for scale in (1e-6, 1.0, 1e6):
        state = {"momentum_buffer": torch.zeros(1, 4, 16, dtype=torch.float64)}
        U, _ = rule.update(scale * G[None], state, hp)
        out.append(torch.linalg.svdvals(U[0]))
    for s in out[1:]:
        torch.testing.assert_close(s, out[0], rtol=1e-9, atol=1e-12)
    tau = rule.options["clip_tau"].default
    assert tau == 0.1
    want = documented_clip(sv, 4, tau, mode)
    torch.testing.assert_close(out[0], want, rtol=1e-7, atol=1e-9)
    if mode == "hard":  # σ(B)·τ = [1.65, 1.10, 0.27, 0.055]·τ: three clipped, one kept
        torch.testing.assert_close(out[0][:3], torch.ones(3, dtype=torch.float64))
        assert 0.5 < out[0][3] < 0.6
    assert out[0].max() <= 1.0 + 1e-9  # spectral norm ≤ 1, Muon's
    assert out[0].square().sum() <= 4.0 + 1e-9  # Frobenius ≤ Muon's √min(m, n)


def test_fp32_update_matches_the_svd():
    sv = torch.logspace(-4, 2, 8, dtype=torch.float64)
    G = with_singular_values(8, 24, sv).float()
    rule = get_rule("musec")
    hp = HP | {k: o.default for k, o in rule.options.items()}
    state = {"momentum_buffer": torch.zeros(1, 8, 24)}
    U, _ = rule.update(G[None], state, hp)
    assert U.dtype == torch.float32
    got = torch.linalg.svdvals(U[0].double())
    want = documented_clip(sv.flip(0), 8, rule.options["clip_tau"].default, "hard")
    # fp32 iterations: ~1e-6 relative to the largest singular value (≤ 1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_zero_gradient_gives_zero_step_and_saturated_momentum_stays_finite():
    W = torch.nn.Parameter(torch.ones(6, 10))
    opt = DMuon([W], lr=0.1, rule="musec", weight_decay=0.0)
    W.grad = torch.zeros(6, 10)
    opt.step()
    assert torch.equal(W.detach(), torch.ones(6, 10))
    W.grad = torch.full((6, 10), 3e38)
    W.grad[0, 0] = -3e38
    opt.step()
    assert torch.isfinite(W).all()


def test_a_clip_level_below_a_millionth_is_refused_when_the_optimizer_is_built():
    """τ = 1e-30: σ_max(B)²/τ² left fp32's range, so every step raised inside the kernel
    (naming its own ``compute_dtype``, not ``clip_tau``) after the momentum had absorbed
    the gradient. Now refused by the group check, naming ``clip_tau``; the smallest
    accepted level steps, finite, at spectral norm one (every direction clipped)."""
    w = torch.nn.Parameter(torch.randn(16, 24, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"clip_tau must be a finite real number >= 1e-06"):
        DMuon([w], rule="musec", clip_tau=1e-30)
    opt = DMuon([w], rule="musec", clip_tau=1e-6, lr=1.0, weight_decay=0.0, adjust_lr=None)
    before = w.detach().clone()
    w.grad = torch.randn(16, 24)
    opt.step()
    update = (before - w.detach()).double()
    assert torch.isfinite(update).all()
    assert abs(float(torch.linalg.matrix_norm(update, ord=2)) - 1.0) < 1e-3
