"""``torch.compile(opt.step)`` and a compiled train step run DMuon's step eagerly, whole.

torch's docs compile ``opt.step`` for ``torch.optim`` optimizers. DMuon's step waits on
collectives under a deadline and reads results on the host, which dynamo cannot trace:
before ``DMuon.step`` was ``torch.compiler.disable``-d, dynamo broke its graph inside
the step (at ``time.monotonic``), ran the Muon part for real (every matrix updated,
momentum written), then crashed in the scalar AdamW part (``Expected scalars to be on
CPU, got meta``) with ``steps_taken`` still 0 — a loop that retried eagerly stepped
every matrix twice. Now the compiled call runs the whole step eagerly: the weights are
bitwise those of the eager step and ``steps_taken`` counts.

The reference is the same model trained with the eager ``opt.step()`` in the same
process (same seeds, same ranks): equality is exact, as both run the same eager code.
Single mode in one process; owner mode (``ddp.dedicate``) on 2 gloo ranks, where
``opt.zero_grad`` is compiled too (it finishes the reductions of a dropped backward:
collectives, also run eagerly). Backend ``aot_eager``, as test_compile.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.compile_check import OPT, Net
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

STEPS = 3


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def train(rank: int, world: int, mode: str, how: str) -> dict:
    """``STEPS`` steps of the tiny model; ``how``: ``"eager"`` (the reference),
    ``"step"`` (``torch.compile(opt.step)``, ``opt.zero_grad`` too) or ``"train_step"``
    (the forward, backward, step and zero_grad in one compiled function)."""
    import torch._dynamo

    from dmuon.integrations import ddp

    torch._dynamo.reset()
    net = Net(16, inputs=16, outputs=8)
    ded = None
    if mode == "owner":
        ded = ddp.dedicate(net)
        opt = DMuon(param_groups(net), distributed=ded, **OPT)
    else:
        opt = DMuon(param_groups(net), **OPT)
    step, zero_grad = opt.step, opt.zero_grad
    if how == "step":
        step = torch.compile(opt.step, backend="aot_eager")
        zero_grad = torch.compile(opt.zero_grad, backend="aot_eager")

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(net(x), y).backward()
        step()
        zero_grad()

    run = torch.compile(train_step, backend="aot_eager") if how == "train_step" else train_step
    for t in range(STEPS):
        run(*batch(t, rank))
        if mode == "owner" and t == 0:
            # a dropped backward: zero_grad finishes its reductions on every rank
            F.mse_loss(net(batch(99, rank)[0]), batch(99, rank)[1]).backward()
            zero_grad()
    if ded is not None:
        ded.wait()
    moments = {
        k: v.clone()
        for i, s in enumerate(opt.state.values())
        for k0, v in s.items()
        if torch.is_tensor(v)
        for k in [f"{i}.{k0}"]
    }
    return {
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "state": moments,
        "steps_taken": opt.steps_taken,
    }


def check_equal(got: dict, want: dict, what: str) -> None:
    assert got["steps_taken"] == want["steps_taken"] == STEPS, (
        f"{what}: steps_taken {got['steps_taken']}, eager {want['steps_taken']}, want {STEPS}"
    )
    for kind in ("params", "state"):
        assert got[kind].keys() == want[kind].keys(), f"{what}: {kind} keys differ"
        for name, w in want[kind].items():
            diff = float((got[kind][name] - w).abs().max()) if w.numel() else 0.0
            assert torch.equal(got[kind][name], w), f"{what}: {kind} {name} differs by {diff:.2e}"


@pytest.mark.parametrize("how", ["step", "train_step"])
def test_compiled_step_single_mode_equals_eager(how):
    want = run_on_ranks(train, 1, args=("single", "eager"), timeout=120)[0]
    got = run_on_ranks(train, 1, args=("single", how), timeout=180)[0]
    check_equal(got, want, f"single mode, compiled {how}")


@pytest.mark.parametrize("how", ["step", "train_step"])
def test_compiled_step_owner_mode_equals_eager(how):
    want = run_on_ranks(train, 2, args=("owner", "eager"), timeout=120)
    got = run_on_ranks(train, 2, args=("owner", how), timeout=240)
    for rank in range(2):
        check_equal(got[rank], want[rank], f"owner mode, rank {rank}, compiled {how}")


def test_fullgraph_step_names_dmuon():
    """``fullgraph=True`` cannot include the eager step: the error says DMuon's why."""
    import torch._dynamo

    torch._dynamo.reset()
    net = nn.Linear(4, 4)
    opt = DMuon(param_groups(net), **OPT)
    net(torch.randn(2, 4)).sum().backward()
    before = net.weight.detach().clone()
    with pytest.raises(Exception, match=re.escape("DMuon.step runs eagerly under torch.compile")):
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    assert torch.equal(net.weight, before), "a refused fullgraph step changed the weights"
    assert opt.steps_taken == 0
