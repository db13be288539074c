"""BatchNorm buffers under ``ddp.dedicate`` stay equal across ranks, as under stock DDP
(issue: reliability, round two, defect 8).

Stock DDP (``broadcast_buffers=True``) copies rank 0's buffers before every forward
run with gradients enabled. The reference is stock DDP itself: a BatchNorm as the
first layer sees only the input batch, so its running statistics at the start of
each forward must be the same under DDP and under ``ddp.dedicate`` — and the same
on every rank. With ``broadcast_buffers=False`` they drift (the old behaviour).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _run(setup: str, rank: int) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp

    model = _model()
    seen: list[torch.Tensor] = []  # BatchNorm's running mean as each forward starts
    model[0].register_forward_pre_hook(lambda m, a: seen.append(m.running_mean.clone()))
    if setup == "ddp":
        forward: nn.Module = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        ded = ddp.dedicate(model, broadcast_buffers=setup != "dedicate_no_broadcast")
        if setup == "dedicate_rehooked":  # taken off and put back: the broadcast with them
            ded.remove()
            ded.reinstall()
        forward, opt = model, DMuon(param_groups(model), lr=1e-2, distributed=ded, timeout=30)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(8, 6, generator=g) * (1 + rank) + rank  # ranks see other data
        forward(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return seen


def buffers_on_ranks(rank: int, world: int) -> dict[str, list[list[torch.Tensor]]]:
    out = {}
    for setup in ("ddp", "dedicate", "dedicate_no_broadcast", "dedicate_rehooked"):
        seen = _run(setup, rank)
        gathered: list[list[torch.Tensor]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, seen)
        out[setup] = gathered
    return out


def test_batchnorm_statistics_are_rank_0s_before_every_forward_as_under_ddp():
    result = run_on_ranks(buffers_on_ranks, 2, timeout=120)[0]
    ddp_ranks, drift = result["ddp"], result["dedicate_no_broadcast"]
    for step in range(STEPS):
        for setup in ("dedicate", "dedicate_rehooked"):  # the latter after ded.reinstall()
            ded_ranks = result[setup]
            # every rank starts each forward from the same statistics ...
            torch.testing.assert_close(ded_ranks[0][step], ded_ranks[1][step], rtol=0, atol=0)
            # ... and they are stock DDP's
            torch.testing.assert_close(ded_ranks[0][step], ddp_ranks[0][step], rtol=0, atol=0)
        torch.testing.assert_close(ddp_ranks[1][step], ddp_ranks[0][step], rtol=0, atol=0)
    # without the broadcast each rank keeps its own statistics: they drift apart
    assert not torch.equal(drift[0][-1], drift[1][-1])
