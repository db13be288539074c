"""A rank-local optimizer state dict loads only on the rank that saved it.

In owner mode each rank's ``DMuon.state_dict()`` holds full state for the parameters
that rank steps and empty placeholders for the rest. Two real gloo ranks train the
small GPT one step (non-zero momentum), save their dicts and swap them: loading the
other rank's dict must raise, naming the parameter, the saving rank and this rank,
and leave the optimizer as it was; loading the rank's own dict restores the state
it saved (bitwise: the values are copied, nothing is computed). The same dict of
rank 0 loaded into a one-process optimizer (another mode and world size) is refused
the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_cases import batch, loss_of, setup

from dmuon.comm.testing import run_on_ranks

NAME = "gpt"


def snapshot(opt) -> tuple[dict[int, dict[str, torch.Tensor]], list[dict]]:
    """The optimizer's state (cloned, by position) and its hyperparameters."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups


def same(a, b) -> bool:
    return (
        a[1] == b[1]
        and all(
            set(a[0][i]) == set(b[0][i])
            and all(torch.equal(a[0][i][k], b[0][i][k]) for k in a[0][i])
            for i in a[0]
        )
        and set(a[0]) == set(b[0])
    )


def run_swap(rank: int, world: int) -> dict:
    from dmuon.comm import all_gather_objects

    _, forward, opt, ded = setup("owner_ddp", NAME, world)
    loss_of(NAME, forward, *batch(NAME, 0, rank, world)).backward()
    opt.step()
    opt.zero_grad()
    ded.wait()
    sd = opt.state_dict()
    dicts = all_gather_objects(sd)
    before = snapshot(opt)
    other = 1 - rank
    try:
        opt.load_state_dict(copy.deepcopy(dicts[other]))
        error = None
    except ValueError as err:
        error = str(err)
    unchanged = same(snapshot(opt), before)
    # The rank's own dict: wipe the state, load, and the saved values are back.
    for st in opt.state.values():
        for v in st.values():
            v.zero_()
    wiped_differs = not same(snapshot(opt), before)
    opt.load_state_dict(copy.deepcopy(dicts[rank]))
    restored = same(snapshot(opt), before)
    # Training goes on from the loaded state (the engine kept its buckets).
    loss_of(NAME, forward, *batch(NAME, 1, rank, world)).backward()
    opt.step()
    ded.wait()
    return {
        "error": error,
        "unchanged": unchanged,
        "wiped_differs": wiped_differs,
        "restored": restored,
        "owned": len(ded.owned),
        "sd": sd if rank == 0 else None,
    }


def test_another_ranks_state_dict_is_refused_and_the_own_one_loads():
    out = run_on_ranks(run_swap, 2, timeout=180)
    for rank, got in enumerate(out):
        assert got["owned"] > 0, f"rank {rank} owns no parameter: the swap would test nothing"
        error = got["error"]
        assert error is not None, f"rank {rank} loaded rank {1 - rank}'s state dict silently"
        assert f"saved by rank {1 - rank} of 2 in 'owner' mode" in error, error
        assert f"this is rank {rank} of 2 in 'owner' mode, which steps it" in error, error
        assert "is an empty placeholder" in error and "parameter 'blocks." in error, error
        assert "Load the state dict this same rank saved" in error, error
        assert "dmuon.integrations.checkpoint" in error, error
        assert got["unchanged"], f"rank {rank}: the refused load changed the optimizer"
        assert got["wiped_differs"], f"rank {rank}: wiping the state changed nothing"
        assert got["restored"], f"rank {rank}: its own state dict did not restore its state"

    # Rank 0's dict in one process (single mode, world size 1): refused the same way.
    _, _, opt, _ = setup("single", NAME, 1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"saved by rank 0 of 2 in 'owner' mode") as info:
        opt.load_state_dict(out[0]["sd"])
    assert "this is rank 0 of 1 in 'single' mode" in str(info.value)
    assert same(snapshot(opt), before)
    # A single-mode dict into single mode still loads.
    single = copy.deepcopy(opt.state_dict())
    next(iter(single["state"].values()))["step"] = torch.tensor(3.0)
    opt.load_state_dict(single)
    assert next(iter(opt.state.values()))["step"].item() == 3.0


# ------------------------------------------- sharded mode: a dict of another world size
# FSDP2's state is DTensors on the saving mesh. torch's load copies them into the live
# DTensors and failed half-way ("different meshes"), leaving some state on the old mesh:
# the next step failed too. Now refused before anything changes, naming both meshes.


def _sharded(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.optim import DMuon, param_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    opt = DMuon(param_groups(model), rule="normuon", lr=0.02)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save_sharded(rank: int, world: int) -> bytes:
    import io

    _, opt = _sharded(world)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue()


def _load_sharded(rank: int, world: int, blobs: list[bytes]) -> tuple[str, bool]:
    import io

    _, opt = _sharded(world)
    before = {
        (id(p), k): (type(v), v.to_local().clone() if hasattr(v, "to_local") else v.clone())
        for p, st in opt.state.items()
        for k, v in st.items()
    }
    theirs = torch.load(io.BytesIO(blobs[rank % len(blobs)]), weights_only=False)
    with pytest.raises(ValueError, match="saved") as err:
        opt.load_state_dict(theirs)
    after = {
        (id(p), k): (type(v), v.to_local() if hasattr(v, "to_local") else v)
        for p, st in opt.state.items()
        for k, v in st.items()
    }
    unchanged = before.keys() == after.keys() and all(
        before[k][0] is after[k][0] and torch.equal(before[k][1], after[k][1]) for k in before
    )
    return str(err.value), unchanged


def test_a_sharded_dict_of_another_world_size_is_refused_before_anything_changes():
    blobs = run_on_ranks(_save_sharded, 2, timeout=90)
    for rank, (message, unchanged) in enumerate(
        run_on_ranks(_load_sharded, 3, args=(blobs,), timeout=90)
    ):
        assert unchanged, f"rank {rank}: the refused load changed the state"
        if rank < 2:  # rank 2 loads rank 0's dict: a placeholder where it steps (refused too)
            assert "mesh of ranks [0, 1]" in message and "ranks [0, 1, 2]" in message, message
