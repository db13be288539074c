"""Scion's spectral step (Pethick et al., arXiv 2502.07529), against its equations.

Restated from the paper for one hidden matrix ``W`` (``m × n``, fan-out × fan-in),
with the EMA momentum the paper writes and the linear minimisation oracle of the
spectral-norm ball of radius ρ:

    d ← β·d + (1 − β)·G
    lmo(d) = −ρ·√(m/n)·polar(d)
    W ← (1 − γ·λ)·W + γ·lmo(d)         λ = 0: uSCG (unconstrained); λ = 1: SCG (Scion)

``polar`` is the Newton–Schulz iteration of ``reference.ns`` (float64), which DMuon's
Gram Newton–Schulz matches to ~1e-13; DMuon keeps the sum-form buffer
``M = d / (1 − β)``, whose polar factor is the same. Tolerance 1e-10 as in
test_rules_reference.py: rounding only, any wrong factor or transpose is far above it.
"""

import math

import pytest
import torch
from reference import ns

from dmuon.optim import DMuon


@pytest.mark.parametrize("constrained", [False, True])
def test_scion_matches_the_papers_update(constrained):
    beta, lr, radius = 0.9, 0.05, 3.0
    wd = 1.0 if constrained else 0.0
    shapes = [(12, 8), (8, 12), (10, 10)]
    torch.manual_seed(0)
    weights = [torch.randn(m, n, dtype=torch.float64) for m, n in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = DMuon(
        [{"params": params, "rule": "scion"}],
        lr=lr,
        momentum=beta,
        nesterov=False,
        weight_decay=wd,
        radius=radius,
        ns_compute_dtype="float64",
    )
    ref = [w.clone() for w in weights]
    d = [torch.zeros_like(w) for w in weights]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(m, n, generator=g, dtype=torch.float64) for m, n in shapes]
        for p, G in zip(params, grads, strict=True):
            p.grad = G.clone()
        opt.step()
        for i, ((m, n), G) in enumerate(zip(shapes, grads, strict=True)):
            d[i] = beta * d[i] + (1 - beta) * G
            lmo = -radius * math.sqrt(m / n) * ns(d[i])
            ref[i] = (1 - lr * wd) * ref[i] + lr * lmo
    for p, w in zip(params, ref, strict=True):
        assert (p.detach() - w).abs().max() < 1e-10


def test_scion_takes_the_callers_radius_and_defaults_to_one():
    p = torch.nn.Parameter(torch.ones(4, 4))
    assert DMuon([p], rule="scion").param_groups[0]["radius"] == 1.0
    assert DMuon([p], rule="scion", radius=50.0).param_groups[0]["radius"] == 50.0
    with pytest.raises(ValueError, match="radius"):
        DMuon([p], rule="scion", radius=0.0)
