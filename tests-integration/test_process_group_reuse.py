"""DMuon and ``dedicate()`` reuse their twin process groups instead of making new ones.

Before: every optimizer and every ``dedicate()`` made its twins with
``dist.new_group`` (the guards' flags, owner mode's presence flags), which
torch.distributed keeps until it is destroyed: 10 optimizers built and deleted left
10 more groups (and their sockets) behind. Now a twin is made once per process, set of
ranks and purpose (:func:`dmuon.comm.process_groups.twin_groups`) and reused: after
the first, building more adds none.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 2
BUILDS = 10


def _groups() -> int:
    # no public listing of the live groups in torch 2.11-2.13: c10d's registry
    return len(dist.distributed_c10d._world.pg_map)


def _build(kind: str) -> None:
    from dmuon.integrations import ddp

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    if kind == "owner":
        ded = ddp.dedicate(model)
        opt = DMuon(param_groups(model), distributed=ded)
        model(torch.randn(2, 8)).sum().backward()  # the flags' and reductions' twins in use
        opt.step()
        ded.undedicate()
    else:
        opt = DMuon(param_groups(model), mode="replicated")
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    del opt
    gc.collect()


def _count(rank: int, world: int, kind: str) -> list[int]:
    start = _groups()
    counts = []
    for _ in range(BUILDS):
        _build(kind)
        counts.append(_groups() - start)
    return counts


@pytest.mark.parametrize("kind", ["replicated", "owner"])
def test_building_again_adds_no_process_group(kind: str):
    for rank, counts in enumerate(run_on_ranks(_count, WORLD, args=(kind,), timeout=60)):
        # the first build makes its twins; every later one reuses them
        assert counts[0] >= 1, f"rank {rank}: {counts}"
        assert counts == [counts[0]] * BUILDS, f"rank {rank}: {counts}"
