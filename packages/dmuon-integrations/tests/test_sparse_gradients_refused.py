"""A sparse gradient is refused by name on the integrations' ways into a step: owner mode
(``ddp.dedicate``, two gloo ranks), where ``DMuon.step`` checks before the engine waits
for the reductions, and DeepSpeed's ``ZeroClientOptimizer``, which steps ZeRO's scalar
groups itself (not through ``DMuon.step``). Nothing is stepped. The other modes:
``packages/dmuon-optim/tests/test_sparse_gradients.py``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import ddp
from dmuon.integrations.deepspeed_optimizer import ZeroClientOptimizer
from dmuon.optim import DMuon, param_groups

MESSAGE = r"sparse gradients: parameter {name}.*nn\.Embedding\(sparse=True\)\); use dense"
CASES = [(n, nf) for n in ("0.weight", "1.bias") for nf in ("raise", None)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def _make_sparse(model: nn.Module, name: str) -> None:
    """Give parameter ``name`` a sparse gradient (its own, else ones)."""
    p = dict(model.named_parameters())[name]
    p.grad = (p.grad if p.grad is not None else torch.ones_like(p)).to_sparse()


def _step_refused(opt: DMuon, model: nn.Module) -> tuple[str | None, bool]:
    """``opt.step()``: the error's text (``None``: it stepped) and whether every parameter
    of ``model`` was left untouched."""
    before = [q.detach().clone() for q in model.parameters()]
    try:
        opt.step()
        error = None
    except RuntimeError as err:
        error = str(err)
    untouched = all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    return error, untouched


def _owner_refusals(rank: int, world: int) -> list[str]:
    """Each of CASES after a backward that launched the reductions: the error's text."""
    texts = []
    for name, nonfinite in CASES:
        model = _model()
        opt = DMuon(param_groups(model), distributed=ddp.dedicate(model), nonfinite=nonfinite)
        assert opt.mode == "owner"
        model(torch.randn(3, 6)).sum().backward()
        _make_sparse(model, name)
        text, untouched = _step_refused(opt, model)
        assert text is not None and untouched, text
        opt.zero_grad()  # every rank alike: finishes and drops the launched reductions
        texts.append(text)
    return texts


def test_owner_mode_names_the_parameter_on_every_rank():
    for texts in run_on_ranks(_owner_refusals, 2, timeout=120):
        for text, (name, _) in zip(texts, CASES, strict=True):
            assert re.search(MESSAGE.format(name=repr(name)), text), text


def test_zero_client_optimizer_names_a_sparse_scalar_gradient():
    # fails before: step_scalars said "DMuon does not support sparse gradients", no name
    model = _model()
    dmuon = DMuon([model[0].weight, model[2].weight], lr=0.02)
    group = {"params": [model[0].bias, model[1].weight], "param_names": ["0.bias", "1.weight"]}
    opt = ZeroClientOptimizer(
        [{**group, "rule": "adamw", "lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8,
          "weight_decay": 0.0}],
        dmuon,
    )  # fmt: skip
    model(torch.randn(3, 6)).sum().backward()
    model[1].weight.grad = model[1].weight.grad.to_sparse()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=MESSAGE.format(name="'1.weight'")):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert not opt.state  # nothing of the group stepped, no state made


def _one_rank_sparse(rank: int, world: int, name: str) -> dict[str, object]:
    """Rank 1 alone makes ``name``'s gradient sparse after a backward: ``0.weight``, whose
    reduction the backward launched, or ``2.weight``, left out of the forward, whose layer
    the step launches. The optimizer's deadline (60 s) is longer than the test's, so a
    rank left waiting fails the test."""
    model = _model()
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, timeout=60)
    forward = model[:2] if name == "2.weight" else model
    forward(torch.randn(3, 6)).sum().backward()
    if rank == 1:
        _make_sparse(model, name)
    error, untouched = _step_refused(opt, model)
    opt.zero_grad()
    model(torch.randn(3, 6)).sum().backward()  # the optimizer stays usable on every rank
    opt.step()
    opt.zero_grad()
    ded.wait()  # the owners' weights published
    weights = [q.detach().clone() for q in model.parameters()]
    return {"error": error, "untouched": untouched, "steps": opt.steps_taken, "w": weights}


@pytest.mark.parametrize("name", ["0.weight", "2.weight"])
def test_owner_mode_refuses_one_ranks_sparse_gradient_on_every_rank(name):
    # before: rank 1 raised in DMuon.step before any collective, and rank 0 waited in the
    # step's first all-reduce until the deadline (60 s), past this test's timeout; with
    # the refusal agreed, the step's flush launching 2.weight's layer on rank 1 failed
    # there ("reshape is not implemented for sparse tensors") until it sent it dense
    out = run_on_ranks(_one_rank_sparse, 2, args=(name,), timeout=40)
    for r in out:
        assert r["error"] is not None and "sparse gradients" in r["error"], r["error"]
        assert "rank(s) [1]" in r["error"], r["error"]
        assert r["untouched"] and r["steps"] == 1
    assert re.search(MESSAGE.format(name=repr(name)), out[1]["error"]), out[1]["error"]
    for a, b in zip(out[0]["w"], out[1]["w"], strict=True):  # the next step, alike
        assert torch.equal(a, b)
