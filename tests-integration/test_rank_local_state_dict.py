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
