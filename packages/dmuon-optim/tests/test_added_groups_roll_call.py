"""A group added after construction that makes the step communicate (``single`` mode,
DTensor matrices split over the ranks: the step's agreement runs over the world) starts
the roll-call responder (:mod:`dmuon.comm.roll_call`) as the constructor does for the
groups it is given: a rank left waiting names the rank that is elsewhere.

Owner, ``replicated``, ``sharded`` and ``sign`` mode refuse ``add_param_group`` after
construction (their plan covers the groups they were built with), and their
constructor always starts the responder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.comm import CollectiveError
from dmuon.comm.testing import rank_store, run_on_ranks
from dmuon.optim import DMuon

ABSENT = 1  # the rank that leaves the loop before step 2


def _absent_at_step_2(rank: int, world: int, later: bool) -> str | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    w = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    b = nn.Parameter(torch.zeros(6))
    matrices = {"params": [w], "param_names": ["w"]}
    scalars = {"params": [b], "param_names": ["b"], "rule": "adamw"}
    if later:  # every matrix comes in through add_param_group
        opt = DMuon([scalars], mode="single", timeout=2, store=rank_store())
        opt.add_param_group(matrices)
    else:
        opt = DMuon([matrices, scalars], mode="single", timeout=2, store=rank_store())
    for step in (1, 2):
        if rank == ABSENT and step == 2:
            return None  # alive, outside DMuon: the roll call finds it there
        # no collective (distribute_tensor broadcasts): rank 0 reaches the step alone
        w.grad = DTensor.from_local(torch.ones(4, 6), mesh, [Shard(0)], run_check=False)
        b.grad = torch.ones(6)
        try:
            opt.step()
        except CollectiveError as err:
            return str(err)
    return None


@pytest.mark.parametrize("later", [False, True], ids=["constructor", "add_param_group"])
def test_the_waiting_rank_names_the_absent_one(later):
    # before, with the matrices added later: "No roll call: no roll-call responder", no
    # rank named
    text = run_on_ranks(_absent_at_step_2, 2, args=(later,), timeout=60)[0]
    assert text is not None, "rank 0 stepped without rank 1"
    assert "no answer within 2 s" in text, text
    assert f"rank {ABSENT} (" in text and "No roll call" not in text, text
