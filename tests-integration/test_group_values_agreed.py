"""A group value one rank alone refuses or changes is refused on every rank alike.

``DMuon.step`` checks the values a caller set since the last step
(``GroupRecord.check``). A value refused on one rank only used to raise on that rank
alone, before the step's agreement: the other ranks entered the step's first
collective alone (a wait to the deadline, then ranks out of step; in owner mode gloo
aborted on the mismatched collective). And values changed on one rank only (a
scheduler stepped on rank 0, ``ReduceLROnPlateau`` fed the local loss) were never
compared: each matrix was stepped with its owner's ``lr``, silently. Both now travel
in the step's agreement (``agree_step``): every rank raises, nothing is updated, and
the next steps, with agreed values, equal one process that never took the refused
steps.
"""

from __future__ import annotations

import pytest
import torch
from distributed_cases import OPT, batch, build, full_params, loss_of, max_diff, setup

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 2
NAME = "mixed"
# the steps taken; 1 (a refused momentum), 2 (rank 1's lr) and 3 (a weight decay past
# float's range: OverflowError, once raised on that rank alone) are refused
KEPT = (0, 4, 5)


def train(rank: int, world: int, mode: str):
    model, forward, opt, ded = setup(mode, NAME, world, dict(OPT, timeout=30))
    errors = {}
    agreed = dict(opt.param_groups[0])
    for t in range(6):
        loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
        group = opt.param_groups[0]
        if rank == 1 and t == 1:
            group["momentum"] = 1.5  # refused by this rank's check alone
        if rank == 1 and t == 2:
            group["lr"] = group["lr"] / 2  # valid, but rank 1's alone
        if rank == 1 and t == 3:
            group["weight_decay"] = 10**400  # float(10**400) raised OverflowError
        try:
            opt.step()
        except ValueError as err:
            errors[t] = (type(err).__name__, str(err))
            if rank == 1:  # agreed again, as a fixed training loop would
                for key in ("momentum", "lr", "weight_decay"):
                    group[key] = agreed[key]
        opt.zero_grad()
    if ded is not None:
        ded.wait()
    return errors, opt.steps_taken, full_params(model)


def reference() -> dict[str, torch.Tensor]:
    """One process, the global batch of the steps taken only."""
    model = build(NAME)
    opt = DMuon(param_groups(model), **OPT)
    for t in KEPT:
        losses = [loss_of(NAME, model, *batch(NAME, t, r, WORLD)) for r in range(WORLD)]
        (sum(losses) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


@pytest.mark.parametrize("mode", ["replicated", "owner_ddp", "sharded"])
def test_a_group_value_of_one_rank_is_refused_on_every_rank(mode):
    results = run_on_ranks(train, WORLD, args=(mode,), timeout=120)
    (errors0, taken0, params0), (errors1, taken1, params1) = results
    # step 1: rank 1 raises its own error; rank 0 one naming rank 1 and the message
    assert errors1[1] == (
        "ValueError",
        "param group 0: momentum must be a real number in [0.0, 1.0), got 1.5",
    )
    name, text = errors0[1]
    assert name == "GroupValuesError" and "rank(s) [1]" in text and "momentum" in text, text
    # step 2: both ranks name the group, the key, each rank's value and the rank
    for errors in (errors0, errors1):
        name, text = errors[2]
        assert name == "GroupValuesError", text
        assert "param group 0 'lr' (rank 0: 0.02, rank 1: 0.01)" in text, text
    # step 3: a ValueError naming the key on rank 1, GroupValuesError on rank 0
    assert errors1[3][0] == "ValueError" and "weight_decay must be" in errors1[3][1]
    assert errors0[3][0] == "GroupValuesError" and "weight_decay" in errors0[3][1]
    assert sorted(errors0) == sorted(errors1) == [1, 2, 3]
    assert taken0 == taken1 == len(KEPT)
    ref = reference()
    for params in (params0, params1):
        diff, where = max_diff(params, ref)
        assert diff < 1e-5, (mode, diff, where)
