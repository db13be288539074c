"""A parameter FSDP2 synchronises, used on some ranks only, is named on every rank
before backward instead of hanging in FSDP2's reduce-scatter (issue: reliability,
round two, defect 2).

The MoE case: rank 1's batch reaches expert 0 only. The experts' matrices are
dedicated (DMuon reduces an absent gradient as zeros), their biases are FSDP2's.
Before: both ranks hung in FSDP2's ``reduce_scatter_single`` (``timeout=`` did not
help; ``ddp.dedicate`` handled the same model). Now: ``PartialUseError`` on every
rank naming ``experts.1.bias``, raised in forward, before any rank enters backward;
and a model whose ranks all use every expert trains as before.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import PartialUseError
from dmuon.optim import DMuon, param_groups


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 8)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, used: list[int]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(sum(self.experts[i](h) for i in used))


def train(rank: int, world: int, partial: bool, rehook: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp

    model = MoE()
    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(model, mesh)
    if rehook:  # taken off and put back (ded.reinstall): the check comes back with them
        ded.remove()
        ded.reinstall()
    # one fully_shard unit: the experts' biases are gathered with the root's (an expert
    # wrapped as its own unit would hang earlier, in FSDP2's forward all-gather)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), distributed=ded, timeout=10)
    used = [0] if (partial and rank == 1) else [0, 1]
    return _train_until_refused(opt, lambda step: model(torch.randn(4, 8), used))


def _train_until_refused(opt: DMuon, forward: Callable[[int], torch.Tensor]) -> dict[str, object]:
    """Three steps of ``forward(step)``; where one is refused, its step and message."""
    for step in range(3):
        try:
            out = forward(step)
        except PartialUseError as err:
            return {"step": step, "error": str(err), "names": err.names}
        F.mse_loss(out, torch.zeros(4, 2)).backward()
        opt.step()
        opt.zero_grad()
    return {"step": None, "error": None, "names": []}


@pytest.mark.parametrize("rehook", [False, True], ids=["hooks", "reinstalled"])
def test_a_parameter_used_on_some_ranks_only_is_named_on_every_rank_before_backward(rehook):
    results = run_on_ranks(train, 2, args=(True, rehook), timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not notice"
        assert r["step"] == 0 and r["names"] == ["experts.1.bias"], r
        assert "some ranks only" in r["error"] and "experts.1.bias" in r["error"], r["error"]


def test_every_expert_used_everywhere_trains_as_before():
    assert [r["error"] for r in run_on_ranks(train, 2, args=(False,), timeout=60)] == [None] * 2


# ------------------------------------------------- owner mode over DDP: the launch order
# A layer used on some ranks only (rank 0 runs `extra`, rank 1 skips it): rank 0 launches
# every layer's reduction in backward; rank 1 stops at `extra`, whose gradients never
# arrive there, and launches it and the layers after it (zeros for `extra`) at the step's
# flush. The flush's presence flags must not be matched against rank 0's reductions: both
# ranks waited until the step's deadline, then raised on the flags' all-reduce. Now the
# step equals one process that averages the two ranks' losses (DDP's average, with
# `extra`'s gradient absent on rank 1).


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a = nn.Linear(8, 8)
            self.extra = nn.Linear(8, 8)
            self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.b(h)


STEPS = 3
OPT = dict(lr=0.02, ns_compute_dtype=torch.float32)  # fp32 Newton–Schulz: compared to 1e-5


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _chain_owner(rank: int, world: int, scalars: str) -> dict[str, torch.Tensor]:
    from dmuon.integrations import ddp

    model = Chain()
    ded = ddp.dedicate(model, scalars=scalars)
    opt = DMuon(param_groups(model), distributed=ded, timeout=15, **OPT)
    for step in range(STEPS):
        out = model(_batch(step, rank), use_extra=rank == 0)
        F.mse_loss(out, torch.zeros(4, 2)).backward()
        opt.step()
        opt.zero_grad()
    opt.engine.settle()  # the last step's publications are in
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _chain_one_process() -> dict[str, torch.Tensor]:
    model = Chain()
    opt = DMuon(param_groups(model), **OPT)
    for step in range(STEPS):
        losses = [
            F.mse_loss(model(_batch(step, r), use_extra=r == 0), torch.zeros(4, 2)) for r in (0, 1)
        ]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("scalars", ["all_reduce", "owner"])
def test_a_layer_used_on_some_ranks_only_steps_as_one_process_in_owner_mode(scalars):
    want = _chain_one_process()
    for rank, got in enumerate(run_on_ranks(_chain_owner, 2, args=(scalars,), timeout=90)):
        for name in want:
            diff = float((got[name] - want[name]).abs().max())
            assert diff < 1e-5, f"rank {rank}: {name} differs by {diff:.2e}"


# ------------------------------------- owner mode, ZeRO-3-like: a layer on some ranks only
# Under reshard_after_forward=True every rank re-gathers a layer's weights in its forward
# and backward pre-hooks, so a layer that ran on some ranks only pairs the ranks'
# broadcasts wrongly (gloo aborted a rank on the size mismatch; two layers of one size
# would swap weights). The check at the end of the training forward names it on every
# rank before any backward broadcast.


def _chain_resharded(rank: int, world: int) -> dict[str, object]:
    from dmuon.integrations import ddp

    model = Chain()
    ded = ddp.dedicate(model, reshard_after_forward=True)
    opt = DMuon(param_groups(model), distributed=ded, timeout=15, **OPT)
    return _train_until_refused(
        opt, lambda step: model(_batch(step, rank), use_extra=step == 1 and rank == 0)
    )


def test_a_layer_used_on_some_ranks_only_under_reshard_after_forward_is_named_on_every_rank():
    """The forward's prefetches may already differ between the ranks (here rank 0 has one
    broadcast more in flight), so the message says the job cannot go on."""
    for rank, r in enumerate(run_on_ranks(_chain_resharded, 2, timeout=90)):
        assert r["step"] == 1 and r["names"] == ["extra.weight"], (rank, r)
        assert "reshard_after_forward=False" in r["error"], r["error"]
        assert "cannot go on" in r["error"] and "restart" in r["error"], r["error"]
        mine = "['extra.weight']" if rank == 0 else "none of them"
        assert f"this rank used {mine}" in r["error"], r["error"]
