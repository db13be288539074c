"""A dedicated model is freed once nothing of its run holds it.

The registry that tells which exchange a parameter is dedicated to held the exchange
strongly, and the exchange holds the parameters and their buckets: neither
``Dedication.remove()`` nor dropping the model, optimizer and dedication freed them
(twice the parameters' memory per dedicated model, for the whole process), and the
same model could not be dedicated again ("dedicated twice") with no object left to let
it go. Now the registry holds the exchange weakly, and the gradient hooks (kept by
torch on the C++ side of each parameter, out of the garbage collector's sight) hold
the reduction weakly: dropping the model, optimizer and dedication frees the
parameters, with or without ``Dedication.remove()`` or ``undedicate()`` first, and the
model (or a new one) can be dedicated again.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from distributed_cases import gelu_mlp
from torch import nn

from dmuon.comm.testing import run_on_ranks


def trained(rank: int, how: str) -> tuple[weakref.ref[torch.Tensor], nn.Module | None]:
    """One step of a dedicated model, then ``how`` (``remove()`` or ``undedicate()``):
    the model is dropped (returned ``None``) or kept, and a weak reference to a
    dedicated weight returned."""
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    m = gelu_mlp()
    ded = ddp.dedicate(m)
    opt = DMuon(param_groups(m), distributed=ded, lr=0.02, ns_compute_dtype=torch.float32)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(m(x), torch.zeros(4, 4)).backward()
    opt.step()
    opt.zero_grad()
    ded.wait()
    if how == "undedicate":
        ded.undedicate()
    elif how != "drop":  # drop: nothing called, everything let go
        ded.remove()
    w = weakref.ref(m[0].weight)
    # keep_model: the optimizer and dedication are dropped, the model kept
    return w, (m if how == "keep_model" else None)


def run(rank: int, world: int, how: str) -> dict[str, object]:
    from dmuon.integrations import ddp
    from dmuon.optim.engine.exchange import any_dedicated, exchange_of

    w, kept = trained(rank, how)
    gc.collect()
    out: dict[str, object] = {"alive": w() is not None, "any_dedicated": any_dedicated()}
    if kept is not None:
        out["still_dedicated"] = exchange_of(kept[0].weight) is not None
        again = kept
    else:
        again = gelu_mlp()
    try:  # a new model, or the kept one, dedicated again
        ddp.dedicate(again).undedicate()
        out["again"] = "ok"
    except ValueError as err:
        out["again"] = str(err)
    return out


def twice(rank: int, world: int) -> str:
    from dmuon.integrations import ddp

    m = gelu_mlp()
    ded = ddp.dedicate(m)
    try:
        ddp.dedicate(m)
    except ValueError as err:
        message = str(err)
    else:
        message = "not refused"
    ded.undedicate()
    ddp.dedicate(m)  # let go: dedicated again
    return message


CASES = ["remove", "undedicate", "keep_model", "drop"]


def run_all(rank: int, world: int) -> dict[str, object]:
    """Every case in one launch (a launch costs more than the cases), one after the
    other: each starts with nothing of the earlier ones left dedicated."""
    out: dict[str, object] = {how: run(rank, world, how) for how in CASES}
    out["twice"] = twice(rank, world)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run_on_ranks(run_all, 2, timeout=240)


@pytest.mark.parametrize("how", CASES)
def test_a_dropped_dedication_frees_its_model(how, results):
    for rank, outs in enumerate(results):
        out = outs[how]
        assert isinstance(out, dict)
        assert out["again"] == "ok", (rank, out)
        if how == "keep_model":
            assert out["alive"] and not out["still_dedicated"], (rank, out)
        else:
            assert not out["alive"], f"rank {rank}: the dedicated weight is still alive ({how})"
        assert not out["any_dedicated"], (rank, out)


def test_dedicated_twice_says_how_to_let_the_first_go(results):
    for outs in results:
        message = str(outs["twice"])
        assert "dedicated twice" in message and "Dedication.undedicate()" in message, message
