"""The size of AdaMuon's, Dion2's, Dion3's and Sign-Muon's steps, against their papers' equations.

``adjust_lr="match_rms_adamw"`` (the default) promises an update of RMS 0.2 (Moonlight,
arXiv 2502.16982, eq. 4), so that AdamW's learning rate carries over. Each test
computes the step the paper writes down — with an exact polar factor from a float64
SVD, not Newton–Schulz — and compares the scale of DMuon's step ``scale·U`` with it.
What they establish (issue 17; the rule pages quote them):

* AdaMuon's step has the paper's RMS, 0.2 (its ``0.2·√(mn)/‖Ô‖_F`` rescale), up to
  Newton–Schulz's inexact singular values.
* Dion2's and Dion3's steps move the selected rows (or columns) exactly as Muon moves
  every row — slice RMS 0.2 — and leave the rest: the whole matrix's RMS is
  ``0.2·√fraction`` (0.1 at the default fraction 0.25). This is the papers'
  convention (microsoft/dion: ``X[sel] −= lr·√(m/n)·O``, the same lr as its Muon),
  reproduced exactly with ``adjust_lr="spectral"``.
* Sign-Muon's step ``S/‖S‖₂`` has Muon's spectral norm under every convention but
  not its RMS: 0.12–0.15 with ``"match_rms_adamw"``, not 0.2.
"""

import math

import pytest
import torch
from reference import ns

from dmuon.optim import get_rule

HP = dict(
    momentum=0.95,
    nesterov=True,
    adjust_lr="match_rms_adamw",
    ns_method="gram",
    ns_coefficients="polar_express",
    ns_steps=5,
    ns_compute_dtype="float64",
)
# Polar Express (5 steps) leaves the singular values of its output within a few per
# cent of 1 on these well-conditioned inputs; the RMS is tested to 5 %.
NS_RTOL = 0.05


def polar(X: torch.Tensor) -> torch.Tensor:
    """The exact polar factor ``U Vᵀ`` (float64 SVD)."""
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh


def run(rule: str, grads: list[torch.Tensor], **over) -> tuple[list[torch.Tensor], dict]:
    """DMuon's steps ``scale·U`` for one matrix, through ``rule.update``."""
    r = get_rule(rule)
    hp = HP | {k: o.default for k, o in r.options.items()} | over
    m, n = grads[0].shape
    state = {
        s.name: torch.zeros(*s.batch_shape(1, m, n), dtype=torch.float64) for s in r.state_specs()
    }
    steps = []
    for t, G in enumerate(grads, start=1):
        U, scale = r.update(G[None].clone(), state, hp, step=t)
        steps.append(scale * U[0])
    return steps, hp


def rms(X: torch.Tensor) -> float:
    return float(X.square().mean().sqrt())


def grads(m: int, n: int, count: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(m, n, generator=g, dtype=torch.float64)
    return [base + 0.5 * torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(count)]


@pytest.mark.parametrize(("m", "n"), [(32, 96), (96, 32), (64, 64)])
def test_adamuon_step_has_the_papers_rms(m, n):
    # Paper (Si, Zhang, Shen, arXiv 2507.11005 v3): O = polar(sign(M)),
    # V ← β₂V + (1−β₂)O∘O, Ô = O/(√V + ε), Δ = 0.2·√(mn)/‖Ô‖_F · Ô (RMS exactly 0.2).
    G = grads(m, n)
    ours, hp = run("adamuon", G)
    M = torch.zeros(m, n, dtype=torch.float64)
    V = torch.zeros(m, n, dtype=torch.float64)
    for G_t, step in zip(G, ours, strict=True):
        M = hp["momentum"] * M + G_t
        O = polar(torch.sign(G_t + hp["momentum"] * M))  # sign is scale-free: EMA = sum form
        V = hp["beta2"] * V + (1 - hp["beta2"]) * O**2
        O_hat = O / (V.sqrt() + hp["eps"])
        paper = 0.2 * math.sqrt(m * n) / O_hat.norm() * O_hat
        assert rms(paper) == pytest.approx(0.2, rel=1e-12)
        assert rms(step) == pytest.approx(0.2, rel=NS_RTOL)
        cos = float((step * paper).sum() / (step.norm() * paper.norm()))
        # The same direction up to Newton–Schulz's error: ≥ 0.996 for the rectangular
        # shapes; a square sign matrix has singular values near 0 that 5 steps leave
        # short of 1, which the elementwise division spreads (0.97 at 64 × 64).
        assert cos > 0.95


def dion_selection(M: torch.Tensor, fraction: float, cols: bool) -> torch.Tensor:
    X = M.T if cols else M
    k = max(1, math.ceil(fraction * X.shape[0]))
    return torch.sort(torch.argsort(X.abs().sum(dim=1), descending=True)[:k]).values


@pytest.mark.parametrize("rule", ["dion2", "dion3"])
@pytest.mark.parametrize(("m", "n"), [(64, 96), (96, 48), (64, 64)])
def test_dion_moves_selected_slices_like_muon_and_nothing_else(rule, m, n):
    G = grads(m, n, count=1)
    (step,), hp = run(rule, G)
    fraction = hp["fraction"]
    cols = rule == "dion2" and n < m  # select_dim="auto": the shorter side (Dion3: rows)
    sel = dion_selection(G[0], fraction, cols)
    X = step.T if cols else step
    rest = torch.ones(X.shape[0], dtype=torch.bool)
    rest[sel] = False
    assert torch.count_nonzero(X[rest]) == 0
    # The selected k × L slice: Muon's RMS (0.2) for that slice's polar factor
    # (k ≤ L here), times √max(m, n)/√L — 1 when L is the longer side.
    k, L = len(sel), X.shape[1]
    expect = 0.2 * math.sqrt(max(m, n)) / math.sqrt(L)
    assert rms(X[sel]) == pytest.approx(expect, rel=NS_RTOL)
    assert rms(step) == pytest.approx(expect * math.sqrt(k / X.shape[0]), rel=NS_RTOL)


@pytest.mark.parametrize(("m", "n"), [(64, 96), (96, 48)])
def test_dion2_with_spectral_scaling_is_the_papers_step(m, n):
    # microsoft/dion dion2.py: U = M[sel]; O = NS(U); X[sel] −= lr·√(m/n)·O (Polar
    # Express NS, restated in float64 by tests/reference.py).
    G = grads(m, n, count=1)
    (step,), hp = run("dion2", G, adjust_lr="spectral")
    cols = n < m
    sel = dion_selection(G[0], hp["fraction"], cols)
    Mw = G[0].T if cols else G[0]
    O = ns(Mw[sel], hp["ns_coefficients"], hp["ns_steps"])
    paper = torch.zeros_like(Mw)
    paper[sel] = math.sqrt(m / n) * O
    torch.testing.assert_close(step, paper.T if cols else paper, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("m", "n"), [(64, 64), (128, 512), (512, 128)])
def test_sign_muon_step_has_muons_spectral_norm_and_a_smaller_rms(m, n):
    # S = sign(polar(M)) / ‖S‖₂, times the adjust_lr factor: Muon's spectral norm
    # (0.2·√max(m, n) with "match_rms_adamw"), but a ±1 matrix has ‖S‖₂ ≥ √max(m, n),
    # and the step's RMS, 0.2·√max(m, n)/‖S‖₂, is below Muon's 0.2 (the page's figures).
    G = grads(m, n, count=1)
    (step,), hp = run("sign_muon", G)
    S = torch.sign(polar(G[0] + hp["momentum"] * G[0]))
    paper = 0.2 * math.sqrt(max(m, n)) * S / torch.linalg.matrix_norm(S, ord=2)
    spectral = float(torch.linalg.matrix_norm(step, ord=2))
    assert spectral == pytest.approx(0.2 * math.sqrt(max(m, n)), rel=1e-9)
    assert 0.11 < rms(step) < 0.16
    assert rms(step) == pytest.approx(rms(paper), rel=NS_RTOL)
