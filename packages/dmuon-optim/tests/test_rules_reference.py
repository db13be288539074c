"""Every rule, run by DMuon (stacked, batched, Gram NS), against reference.py's
unbatched float64 re-statement of its equations, on several shapes.

Both sides compute in float64; the only differences are rounding (Gram vs
standard NS, batched vs single products), ~1e-13 after a few steps, so 1e-10 is
a tolerance that still catches any wrong sign, factor, transpose or state update.
"""

import pytest
import torch
from reference import init_state, rule_step

from dmuon.optim import RULES, DMuon

# Two of the same shape share a bucket; tall, wide, square and very wide ones.
SHAPES = [(12, 8), (12, 8), (8, 12), (10, 10), (6, 20)]
STEPS = 4
BASE = dict(
    lr=0.05,
    momentum=0.9,
    nesterov=True,
    weight_decay=0.1,
    adjust_lr="match_rms_adamw",
    ns_method="gram",
    ns_coefficients="polar_express",
    ns_steps=5,
    ns_compute_dtype="float64",
)

CASES = [(r, {}) for r in sorted(RULES)] + [
    ("muon", {"adjust_lr": "original", "nesterov": False}),
    ("muon", {"adjust_lr": "spectral", "ns_coefficients": "keller", "ns_method": "standard"}),
    ("muon", {"adjust_lr": None, "momentum": 0.0}),
    ("adamuon", {"sign": False}),
    # ε comparable to V (G ~ N(0, 1), so V ~ 0.05–0.2): where ε sits (inside the root,
    # the paper's) and the absence of bias correction both move the step; at the default
    # ε = 1e-16 neither is visible
    ("muon2", {"muon2_eps": 0.25}),
    ("musec", {"clip_mode": "soft"}),
    ("musec", {"clip_tau": 2.0}),
    ("sign_muon", {"local_polar": True}),
    ("dion2", {"select_dim": "rows", "fraction": 0.5}),
    ("dion2", {"select_dim": "cols"}),
    ("dion3", {"fraction": 0.6}),
    ("muonbp", {"period": 3, "row_blocks": 3, "col_blocks": 2, "adjust_lr": "spectral"}),
    ("muonbp", {"period": 2, "block_lr_scale": 0.5, "full_lr_scale": 2.0}),
    ("numuon", {"rank_fraction": 0.5}),
    ("mona", {"mona_beta": 0.5, "mona_gamma": 2.0, "nesterov": False}),
]


def grads_for(rule, shapes, step):
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i, (m, n) in enumerate(shapes):
        if rule == "musec":
            # Fixed singular vectors and values far from the clipping level, so the
            # Newton–Schulz-type clip resolves every σ (see dmuon.kernels.spectral_clip).
            gi = torch.Generator().manual_seed(i)
            U, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=gi, dtype=torch.float64))
            V, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=gi, dtype=torch.float64))
            s = torch.tensor([40.0, 20.0, 0.5, 0.1] * 5, dtype=torch.float64)[: min(m, n)]
            out.append(U @ torch.diag(s) @ V.T)
        else:
            out.append(torch.randn(m, n, generator=g, dtype=torch.float64))
    return out


@pytest.mark.parametrize(("rule", "over"), CASES, ids=lambda x: str(x) if x else "")
def test_rule_matches_float64_restatement(rule, over):
    hp = {**BASE, **{k: o.default for k, o in RULES[rule].options.items()}, **over}
    torch.manual_seed(0)
    weights = [torch.randn(m, n, dtype=torch.float64) for m, n in SHAPES]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = DMuon([{"params": params, "rule": rule, **hp}])
    states = [init_state(rule, m, n) for m, n in SHAPES]
    ref = [w.clone() for w in weights]
    for t in range(1, STEPS + 1):
        grads = grads_for(rule, SHAPES, t)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        ref = [
            rule_step(rule, w, g, st, hp, t) for w, g, st in zip(ref, grads, states, strict=True)
        ]
    for p, w, st in zip(params, ref, states, strict=True):
        assert (p.detach() - w).abs().max() < 1e-10, (p.shape, (p.detach() - w).abs().max())
        for key, value in st.items():
            assert (opt.state[p][key] - value).abs().max() < 1e-10, key
        assert opt.state[p]["step"].item() == STEPS
