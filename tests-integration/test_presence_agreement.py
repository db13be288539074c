"""``sharded`` and ``sign`` modes carry the gradient-presence flags in the step's agreement.

Both modes need to know which parameters have a gradient on some rank (a missing one is
stepped as zeros, one missing everywhere is skipped); the flags used to take an
all-reduce (and a host read) of their own after the agreement's. They now ride in the
agreement's all-reduce (``PlannedEngine.begin_step_agreeing``): one small all-reduce a
step. The weights are those of the separate all-reduce (the engine's fallback, forced
here) and of one process on the same global gradients.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_cases import OPT, TOLERANCE, max_diff
from torch import nn

from dmuon.comm import default_stats
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, StepMismatchError, param_groups

STEPS = 3
ROWS = 8  # of every matrix: rank r of 2 holds rows [4r, 4r + 4) under FSDP2


class Net(nn.Module):
    """``a`` used everywhere, ``b`` dropped on rank 1 (a gradient on rank 0 only), ``c``
    never used (no gradient on any rank)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.a = nn.Parameter(torch.randn(ROWS, 6, generator=g) / 3)
        self.b = nn.Parameter(torch.randn(4, ROWS, generator=g) / 3)
        self.c = nn.Parameter(torch.randn(ROWS, ROWS, generator=g) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.T) @ self.b.T


def data(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(12, 6, generator=g), torch.randn(12, 4, generator=g)
    rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
    return x[rows], y[rows]


def drop(model: nn.Module, rank: int) -> None:
    """Rank 1 drops its gradient of ``b`` (its shard of it, under FSDP2)."""
    if rank == 1:
        model.b.grad = None


def train(rank: int, world: int, mode: str, carried: bool):
    """Train ``mode``; count the integer all-reduces (the agreement's and the presence
    flags') of the last, warm step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net()
    kw = dict(OPT)
    if mode == "sharded":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        kw["mode"] = "sharded"
    else:
        kw.update(mode="sign", rule="sign_muon")
    opt = DMuon(param_groups(model), **kw)
    if not carried:  # the separate all-reduce of the presence flags, as before
        opt._engine._presence_at = None
    calls: list[tuple[torch.dtype, int]] = []
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append((tensor.dtype, tensor.numel()))
        return real(tensor, *args, **kwargs)

    for t in range(STEPS):
        F.mse_loss(model(data(t, rank, world)[0]), data(t, rank, world)[1]).backward()
        drop(model, rank)
        calls.clear()
        default_stats().reset()
        dist.all_reduce = counted
        try:
            opt.step()
        finally:
            dist.all_reduce = real
        opt.zero_grad()
    small = [c for c in calls if not c[0].is_floating_point]
    flags = default_stats().ops["presence_flags"].collectives
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return full, small, flags


def single_sharded_reference(world: int) -> dict[str, torch.Tensor]:
    """One process on the global batch, ``b``'s gradient rows of rank 1 zeroed (what rank
    1 sends for a gradient it dropped: zeros)."""
    model = Net()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        losses = [
            F.mse_loss(model(data(t, r, world)[0]), data(t, r, world)[1]) for r in range(world)
        ]
        (sum(losses) / world).backward()
        model.b.grad[2:] = 0  # b has 4 rows: rank 1 holds rows 2 and 3
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["sharded", "sign"])
def test_a_warm_step_makes_one_small_all_reduce_for_agreement_and_presence(mode):
    world = 2
    carried = run_on_ranks(train, world, args=(mode, True), timeout=120)
    separate = run_on_ranks(train, world, args=(mode, False), timeout=120)
    params = 3
    for rank, (_, small, flags) in enumerate(carried):
        # the agreement's slots (one per rank and four for the group values) and one
        # presence flag per parameter, int64, in one all-reduce
        assert small == [(torch.int64, world + 4 + params)], (rank, small)
        assert flags == 1, (rank, flags)
    for rank, (_, small, _) in enumerate(separate):
        assert len(small) == 2, (rank, small)  # the fallback: as before the change
    initial = {n: p.detach().clone() for n, p in Net().named_parameters()}
    for rank in range(world):
        got, want = carried[rank][0], separate[rank][0]
        assert all(torch.equal(got[n], want[n]) for n in want), rank
        assert torch.equal(got["c"], initial["c"]), "a parameter no rank has a gradient for moved"
        assert not torch.equal(got["b"], initial["b"]), "a gradient on rank 0 only was not stepped"
        assert all(torch.equal(got[n], carried[0][0][n]) for n in got), "ranks differ"


def test_sharded_mode_with_a_gradient_on_one_rank_only_equals_one_process():
    expected = single_sharded_reference(2)
    for rank, (got, _, _) in enumerate(run_on_ranks(train, 2, args=("sharded", True), timeout=120)):
        diff, where = max_diff(got, expected)
        # fp32 Newton–Schulz: only the order of the gradient sums differs (~1e-7 relative)
        assert diff <= TOLERANCE, f"rank {rank}: {where} differs by {diff:.2e}"


def mismatched(rank: int, world: int, mode: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net()
    kw = dict(OPT)
    if mode == "sharded":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        kw["mode"] = "sharded"
    else:
        kw.update(mode="sign", rule="sign_muon")
    opt = DMuon(param_groups(model), timeout=20, **kw)
    F.mse_loss(model(data(0, rank, world)[0]), data(0, rank, world)[1]).backward()
    if rank == 1:
        opt.steps_taken += 1
    try:
        opt.step()
    except StepMismatchError as err:
        return err.steps
    return None


@pytest.mark.parametrize("mode", ["sharded", "sign"])
def test_ranks_at_different_steps_still_raise_on_every_rank(mode):
    for rank, steps in enumerate(run_on_ranks(mismatched, 2, args=(mode,), timeout=60)):
        assert steps == {0: 1, 1: 2}, (rank, steps)
