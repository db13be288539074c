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


def rank_0s_weights(rank: int, world: int, scalars: str, zero3: bool) -> bool:
    """Every rank but 0 starts from other weights (a checkpoint loaded on rank 0 alone, the
    DDP habit); after ``dedicate`` every rank holds rank 0's, the matrices each rank does
    not own included, as ``DistributedDataParallel`` broadcasts them when it is built."""
    from dmuon.integrations import ddp

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    torch.manual_seed(0)
    loaded = {n: torch.randn_like(p) for n, p in model.named_parameters()}  # the checkpoint
    if rank == 0:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(loaded[n])
    ded = ddp.dedicate(model, scalars=scalars, reshard_after_forward=zero3, layer_pack_mb=0)
    assert sorted(set(ded.exchange.plan.owners)) == list(range(world))  # every rank owns some
    ded.wait()  # ZeRO-3-like: gathers the weights this rank does not own
    state = model.state_dict()
    return all(torch.equal(state[n], loaded[n]) for n in loaded)


def test_dedicate_starts_every_rank_from_rank_0s_weights_as_ddp_does():
    for scalars, zero3 in (("all_reduce", False), ("owner", False), ("all_reduce", True)):
        same = run_on_ranks(rank_0s_weights, 2, args=(scalars, zero3), timeout=120)
        assert same == [True, True], (scalars, zero3, same)
