"""ZeroClientOptimizer, what ZeRO-1/2 is handed in owner mode, without DeepSpeed.

ZeRO replaces each scalar group's parameters by this rank's slice of their flat fp32
copy and calls ``step()`` once per group with ``param_groups`` narrowed to it. Here
that is done by hand: the slices must take exactly the AdamW step DMuon takes on the
whole tensors, and the matrices' owner step must run once per round of groups.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.integrations.deepspeed_optimizer import ZeroClientOptimizer
from dmuon.optim import DMuon

HYPER = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _scalar_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    return [[model[0].bias, model[2].bias], [model[1].weight, model[1].bias]]


def test_slices_step_like_whole_tensors_and_matrices_step_once_per_round():
    ref, zero = _model(), _model()
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    groups = _scalar_groups(ref)
    reference = DMuon(
        [{"params": [ref[0].weight, ref[2].weight]}]
        + [
            {"params": g, "rule": "adamw", "weight_decay": wd}
            for g, wd in zip(groups, (0.1, 0.0), strict=True)
        ],
        lr=0.02,
        adamw_lr=HYPER["lr"],
        adamw_betas=HYPER["betas"],
        adamw_eps=HYPER["eps"],
    )
    dmuon = DMuon([zero[0].weight, zero[2].weight], lr=0.02)
    steps = []
    dmuon.register_step_post_hook(lambda *_: steps.append(1))
    # ZeRO's view: each group flattened, cut into two "ranks'" slices; this process holds both.
    flats = [torch.cat([p.detach().flatten() for p in g]) for g in _scalar_groups(zero)]
    slices = [list(f.clone().tensor_split(2)) for f in flats]
    opt = ZeroClientOptimizer(
        [
            {"params": s, "rule": "adamw", "weight_decay": wd, **HYPER}
            for s, wd in zip(slices, (0.1, 0.0), strict=True)
        ],
        dmuon,
    )
    everything = opt.param_groups
    for t in range(3):
        for model in (ref, zero):
            nn.functional.mse_loss(model(x), y).backward()
        reference.step()
        reference.zero_grad()
        for g, s in zip(_scalar_groups(zero), slices, strict=True):
            grad = torch.cat([p.grad.flatten() for p in g])
            for piece, gpiece in zip(s, grad.tensor_split(2), strict=True):
                piece.grad = gpiece.clone()
        for group in everything:  # as ZeRO's _optimizer_step does, one group per call
            opt.param_groups = [group]
            opt.step()
        opt.param_groups = everything
        assert len(steps) == t + 1, "the matrices must step once per round of groups"
        assert zero[0].weight.grad is None  # cleared after the owner step
        with torch.no_grad():  # ZeRO copies the updated slices back into the parameters
            for g, s in zip(_scalar_groups(zero), slices, strict=True):
                flat = torch.cat(s)
                offset = 0
                for p in g:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    p.grad = None
                    offset += p.numel()
    for (name, a), b in zip(ref.named_parameters(), zero.parameters(), strict=True):
        # the same elementwise AdamW and the same Newton–Schulz on the same numbers; 1e-6
        # leaves room only for torch choosing its foreach or per-tensor AdamW path
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{name}")


def _zero_step(opt: ZeroClientOptimizer) -> None:
    """ZeRO-1/2's stepping: one call per group, ``param_groups`` narrowed to it."""
    everything = opt.param_groups
    for group in everything:
        opt.param_groups = [group]
        opt.step()
    opt.param_groups = everything


def test_load_state_dict_is_refused_alone_and_keeps_stepping_the_matrices_after():
    model = _model()
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    dmuon = DMuon([model[0].weight, model[2].weight], lr=0.02)
    groups = [{"params": g, "rule": "adamw", "weight_decay": 0.0, **HYPER} for g in
              _scalar_groups(model)]  # fmt: skip
    opt = ZeroClientOptimizer(groups, dmuon)
    nn.functional.mse_loss(model(x), y).backward()
    _zero_step(opt)
    saved = opt.state_dict()
    before = {k: v.clone() for k, v in opt.state[model[1].weight].items()}

    # engine.load_checkpoint would call this alone: the matrices' momentum would be lost.
    with pytest.raises(RuntimeError, match="DMuon's matrix momentum"):
        opt.load_state_dict(saved)
    assert all(torch.equal(opt.state[model[1].weight][k], v) for k, v in before.items())

    # dmuon.integrations.deepspeed.load_checkpoint loads DMuon's state next: allowed, and
    # the owner step still runs with the last group (torch replaced the group dicts).
    opt.dmuon_state_loaded_separately = True
    opt.load_state_dict(saved)
    opt.dmuon_state_loaded_separately = False
    steps = []
    dmuon.register_step_post_hook(lambda *_: steps.append(1))
    w = model[0].weight.detach().clone()
    nn.functional.mse_loss(model(x), y).backward()
    _zero_step(opt)
    assert steps == [1], "DMuon's step did not run after load_state_dict"
    assert not torch.equal(model[0].weight, w)
    assert model[0].weight.grad is None


def test_a_scalar_groups_keys_are_the_ones_its_rule_reads(monkeypatch):
    """A scalar rule of one's own that reads ``eps`` (AdamW's keys under another name)
    gets ``adamw_eps`` in DeepSpeed's client optimizer as in DMuon (before: ``eps`` was
    kept for ``"adamw"`` alone, and the client optimizer refused the group, "missing
    'eps'"); Lion, which reads none, loses one given to it."""
    from dataclasses import replace

    from dmuon.integrations.deepspeed import _dmuon_defaults, _scalar_group
    from dmuon.optim import scalar

    monkeypatch.setitem(
        scalar.SCALAR_RULES, "adamw2", replace(scalar.SCALAR_RULES["adamw"], name="adamw2")
    )
    defaults = _dmuon_defaults({"adamw_eps": 1e-3, "lr": 0.02})
    group = _scalar_group({"params": []}, "adamw2", defaults)
    assert group["eps"] == 1e-3 and group["rule"] == "adamw2"
    assert "eps" not in _scalar_group({"params": [], "eps": 1e-3}, "lion", defaults)
    assert _scalar_group({"params": [], "eps": 1e-5}, "adamw", defaults)["eps"] == 1e-5
