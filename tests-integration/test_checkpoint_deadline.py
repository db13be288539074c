"""A rank that does not join a checkpoint makes the others raise at DMuon's deadline.

Saving is a collective. Each case trains one step on 2 gloo ranks, then rank 1 does
not save (it sleeps for four deadlines, then leaves) while rank 0 saves with the
optimizer's ``timeout=2``. Rank 0 must leave the save with a
:class:`~dmuon.comm.CollectiveError` that names rank 1 as alive but outside any DMuon
collective and says which save it was in — not wait for the process group's 30
minutes (``run_on_ranks``' 60 s would turn that into a failure). Cases: the DCP save
and the one-file ``full_state_dict`` in owner mode (the owners' ``step`` all-reduce,
the broadcasts and sends of owned state), ``full_state_dict`` of a tensor-parallel
model in ``single`` mode (the weights' and the momenta's shards gathered over ``tp``:
``checkpoint/whole.py``, where DTensor's ``full_tensor()`` waited for the process
group), and ``gather_full_state_dict`` in replicated mode (the Hugging Face Trainer's
path: the owners' broadcasts). Two more: a rank late to the DCP save's owner-rooted
scatter (``sharded_state.scattered``, where ``distribute_tensor(..., src_data_rank=owner)``
waited untimed), and a rank missing from ``full_state_dict`` of FSDP2 over tensor
parallelism (the ``_StridedShard`` rows, which ``full_tensor()`` gathered untimed).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from distributed_cases import OPT
from torch import nn

from dmuon.comm import CollectiveError
from dmuon.comm.testing import RankFailure, rank_store, run_on_ranks
from dmuon.optim import DMuon, param_groups

DMUON_TIMEOUT = 2.0
ABSENT = 1
WHAT = {
    "dcp": "DMuon checkpoint save",
    "full": "DMuon checkpoint save (full)",
    "tp": "DMuon checkpoint save (full)",
    "hf": "DMuon state gather (gather_full_state_dict)",
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def run_save(rank: int, world: int, how: str, directory: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import checkpoint, ddp
    from dmuon.integrations.hf import gather_full_state_dict

    model = _net()
    kw = dict(OPT, timeout=DMUON_TIMEOUT, store=rank_store())
    forward: nn.Module = model
    ded = None
    seed = rank
    if how == "tp":  # the first and second layers over tp 2; every rank the same batch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        kw["mode"], seed = "single", 0
    elif how == "hf":
        forward, kw["mode"] = DDP(model), "replicated"
    else:
        ded = kw["distributed"] = ddp.dedicate(model)
    opt = DMuon(param_groups(model), **kw)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    F.mse_loss(forward(x), torch.zeros(4, 2)).backward()
    opt.step()
    if ded is not None:
        ded.wait()
    if rank == ABSENT:  # takes another branch: never saves, then leaves
        time.sleep(4 * DMUON_TIMEOUT)
        raise SystemExit("the absent rank gives up")
    t0 = time.monotonic()
    try:
        if how == "dcp":
            checkpoint.save(directory, model, opt)
        elif how in ("full", "tp"):
            checkpoint.full_state_dict(model, opt)
        else:
            gather_full_state_dict(opt)
    except CollectiveError as err:
        return {"error": str(err), "reason": err.reason, "seconds": time.monotonic() - t0}
    return {"error": None}


def saver_after_the_absent_rank_left(run, world: int, args=()) -> dict:
    """What rank 0 returned from ``run`` on ``world`` ranks, whose absent rank leaves
    (raises) after four deadlines: rank 0 returned an error, and nobody hung."""
    with pytest.raises(RankFailure) as info:
        run_on_ranks(run, world, args=args, timeout=60)
    failure = info.value
    assert not failure.timed_out, str(failure)
    saver = failure.outcomes[0]
    assert saver.status == "ok", f"rank 0: {saver.summary()}\n{saver.traceback}"
    assert saver.value["error"] is not None, "rank 0 saved without the absent rank"
    return saver.value


def assert_raised_at_the_deadline(saver: dict, what: str) -> None:
    """Rank 0 left ``what`` with ``CollectiveError`` at DMuon's deadline, not when the
    absent rank left or came (four deadlines later)."""
    text = saver["error"]
    assert saver["reason"] == "timeout", text
    assert text.startswith(what), text
    assert f"no answer within {DMUON_TIMEOUT:g} s" in text, text
    assert saver["seconds"] < 4 * DMUON_TIMEOUT, saver


@pytest.mark.parametrize("how", ["dcp", "full", "tp", "hf"])
def test_a_rank_missing_from_a_save_is_named_at_the_deadline(tmp_path, how):
    saver = saver_after_the_absent_rank_left(run_save, 2, (how, str(tmp_path / "ckpt")))
    assert_raised_at_the_deadline(saver, WHAT[how])
    text = saver["error"]
    if how == "tp":  # the first gather of the model's weights
        assert "the all-gather of '0.weight' (Shard(0) over mesh dim 'tp')" in text, text
    # single mode over tp starts the roll-call responder too (its step agrees over tp)
    assert f"rank {ABSENT} (" in text and "alive but not in a DMuon collective" in text, text


def run_late_to_scatter(rank: int, world: int):
    """Owner mode, one step; then rank 1 stalls for four deadlines just before the save's
    first owner-rooted scatter (at the mesh it is made on), rank 0 goes on into it."""
    from dmuon.integrations import checkpoint, ddp
    from dmuon.integrations.checkpoint import sharded_state

    model = _net()
    ded = ddp.dedicate(model)
    kw = dict(OPT, timeout=DMUON_TIMEOUT, store=rank_store())
    opt = DMuon(param_groups(model), distributed=ded, **kw)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(model(x), torch.zeros(4, 2)).backward()
    opt.step()
    ded.wait()
    if rank == ABSENT:
        mesh = sharded_state._mesh

        def late(*args):
            time.sleep(4 * DMUON_TIMEOUT)
            return mesh(*args)

        sharded_state._mesh = late  # type: ignore[assignment]
    t0 = time.monotonic()
    try:
        checkpoint.optimizer_state_dict(model, opt)
    except CollectiveError as err:
        return {"error": str(err), "reason": err.reason, "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def test_a_rank_late_to_an_owners_scatter_is_named_at_the_deadline():
    """The DCP save's scatter of owner-held state into row blocks over the owners' group
    (``sharded_state.scattered``) waits under the optimizer's deadline: rank 0 raises
    ``CollectiveError`` naming the scatter at the 2 s deadline. Before, torch's
    ``distribute_tensor(..., src_data_rank=owner)`` scattered with no deadline: rank 0
    waited until rank 1 came, 8 s later (the process group's 30 min for a rank that
    never comes)."""
    saver = run_on_ranks(run_late_to_scatter, 2, timeout=60)[0]
    text = saver["error"]
    assert text is not None, f"rank 0 waited for the late rank: {saver}"
    assert_raised_at_the_deadline(saver, WHAT["dcp"])
    assert "scatter of rank " in text and "'momentum_buffer' of " in text, text
    assert f"rank {ABSENT} (" in text and "alive but not in a DMuon collective" in text, text


def run_strided(rank: int, world: int):
    """FSDP2 over dp 2 of tensor parallelism over tp 2, one step; then rank 2 (rank 0's dp
    partner) does not save, the others call ``full_state_dict``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dmuon.integrations import checkpoint

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _net()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = DMuon(param_groups(model), **dict(OPT, timeout=DMUON_TIMEOUT))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(mesh.get_coordinate()[0]))
    F.mse_loss(model(x), torch.zeros(4, 2)).backward()
    opt.step()
    if rank == 2:  # takes another branch: never saves, then leaves
        time.sleep(4 * DMUON_TIMEOUT)
        raise SystemExit("the absent rank gives up")
    t0 = time.monotonic()
    try:
        checkpoint.full_state_dict(model, opt)
    except CollectiveError as err:
        return {"error": str(err), "reason": err.reason, "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_rank_missing_from_an_fsdp_over_tensor_parallel_gather_is_named_at_the_deadline():
    """``full_state_dict`` of FSDP2 over tensor parallelism gathers the ``_StridedShard``
    rows over ``dp`` (then ``tp``) with DMuon's own all-gathers: rank 0 raises
    ``CollectiveError`` at the deadline naming the gather over ``dp`` of the first weight,
    whose partner never came. Before, ``DTensor.full_tensor()`` gathered them with no
    deadline: rank 0 waited until rank 2 left (a raw gloo error), or 30 min."""
    saver = saver_after_the_absent_rank_left(run_strided, 4)
    assert_raised_at_the_deadline(saver, WHAT["full"])
    text = saver["error"]
    assert "the all-gather of '0.weight' (_StridedShard(0, 2) over mesh dim 'dp')" in text, text
