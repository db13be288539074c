"""No rank hangs when a peer dies or stops in the middle of a step.

A rank is a real process: the faulty one kills itself with ``SIGKILL`` (no Python
clean-up, its sockets simply close) or sleeps instead of stepping. Every other
rank must leave ``opt.step()`` with :class:`dmuon.comm.CollectiveError` — never
hang — and the message must name the step, the collective and the rank at fault:
the one that did not answer the roll call after a death, the one alive but outside
any DMuon collective after a hang (:mod:`dmuon.comm.roll_call`). ``run_on_ranks``'
own timeout (60 s) is the guard that turns a hang into a failure; DMuon's
``timeout`` is 2 s here.

Faults are injected inside ``step()``: the dying rank wraps its optimizer's
per-layer matrix step so that it dies after stepping its first layer, while the
others are already waiting for its results (owner broadcasts, all-gathers,
all-to-alls). With owner mode's default packing of small layers, the dying rank
instead stops between a pack's reduction and its publication.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from distributed_cases import OPT as CASES_OPT
from distributed_cases import TanhNet
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dmuon.comm import CollectiveError
from dmuon.comm.testing import RankFailure, rank_store, run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 3
FAULTY = 2
# below run_on_ranks' 3 s grace after a first failure (a rank that dies), so that every
# survivor reports its own error before the harness stops it
DMUON_TIMEOUT = 2.0
# the first step (plans, state, first collectives) runs under a generous deadline: on a
# loaded machine a rank merely slow there must not time the others out before the fault
WARMUP_TIMEOUT = 30.0

# the default step (whatever DMUON_TEST_CHECK_EVERY says): a step that checks waits for
# its publications at its end, where the faults below expect the next forward to wait
OPT = dict(CASES_OPT, check_every=None)


def build(mode: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp

    model = TanhNet()
    forward: nn.Module = model
    kw = dict(OPT, timeout=WARMUP_TIMEOUT, store=rank_store())
    # a layer a unit (these small layers would be one pack): the fault strikes between
    # two layers' steps, while the first layer's publication (owner mode), all-gather
    # (replicated) or all-to-all back (sharded) is in flight
    if mode == "owner":
        kw["distributed"] = ddp.dedicate(model, layer_pack_mb=0)
    else:
        kw["layer_pack_mb"] = 0
    if mode == "replicated":
        forward = DDP(model)
        kw["mode"] = "replicated"
    elif mode == "sharded":
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, forward, DMuon(param_groups(model), **kw)


def faulty(matrix_step, fault: str, calls: int = 2):
    """``matrix_step`` that dies (or stops) after its ``calls``-th call: mid-step."""
    made = []

    def step(*args, **kwargs):
        matrix_step(*args, **kwargs)
        made.append(1)
        if len(made) == calls:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            # "hang": alive, but not joining the next collective for 4 deadlines; then it
            # leaves, so the harness need not wait for its own timeout
            time.sleep(4 * DMUON_TIMEOUT)
            raise SystemExit("the hanging rank gives up")

    return step


def train_with_fault(rank: int, forward: nn.Module, opt: DMuon, fault, *, seed: int):
    """Three steps of ``forward`` and ``opt``; step 1 under the warm-up deadline, the
    others under DMuon's. On :data:`FAULTY`, ``fault()`` is called as step 2 begins: it
    swaps in the part of the step that dies or stops. A :class:`CollectiveError` ends
    the loop, returned as what the tests read."""
    g = torch.Generator().manual_seed(seed)
    for step in range(1, 4):
        if step == 2:
            opt.timeout = DMUON_TIMEOUT  # from step 2 on, where the fault strikes
            if rank == FAULTY:
                fault()
        x = torch.randn(4, 8, generator=g)
        t0 = time.monotonic()
        try:  # owner mode: a survivor may only notice in the next forward (publications)
            F.mse_loss(forward(x), torch.zeros(4, 2)).backward()
            opt.step()
        except CollectiveError as err:
            return {
                "error": str(err),
                "reason": err.reason,
                "dead_rank": err.dead_rank,
                "seconds": time.monotonic() - t0,
            }
        opt.zero_grad()
    return {"error": None}


def run_fault(rank: int, world: int, mode: str, fault: str):
    _, forward, opt = build(mode, world)

    def mid_step() -> None:
        opt.step_matrices = faulty(opt.step_matrices, fault)

    return train_with_fault(rank, forward, opt, mid_step, seed=rank)


def outcomes(run, *args) -> RankFailure:
    """The failure of ``run`` on :data:`WORLD` ranks (the faulty rank never returns)."""
    try:
        run_on_ranks(run, WORLD, args=args, timeout=60)
    except RankFailure as failure:
        return failure
    raise AssertionError("the faulty rank should not have returned")


def survivors(failure: RankFailure) -> list[dict]:
    """Each rank but :data:`FAULTY`, with what it returned: it left its steps with a
    :class:`CollectiveError` (never hung, never finished without noticing)."""
    left = []
    for o in failure.outcomes:
        if o.rank == FAULTY:
            continue
        assert o.status == "ok", f"rank {o.rank}: {o.summary()}\n{o.traceback}"
        assert o.value["error"] is not None, f"rank {o.rank} finished its steps without noticing"
        left.append(o.value)
    return left


def assert_names_the_dead_rank(value: dict) -> None:
    """The survivor's roll call named :data:`FAULTY` as dead, by number."""
    text = value["error"]
    assert value["dead_rank"] == FAULTY, text
    assert f"rank {FAULTY} did not answer" in text, text


@pytest.mark.parametrize("mode", ["owner", "replicated", "sharded"])
def test_a_rank_killed_mid_step_makes_every_other_rank_raise_naming_the_step(mode):
    failure = outcomes(run_fault, mode, "kill")
    assert not failure.timed_out, str(failure)  # nobody hung until run_on_ranks' timeout
    dead = failure.outcomes[FAULTY]
    assert dead.status == "died" and dead.exitcode == -signal.SIGKILL
    for value in survivors(failure):
        text = value["error"]
        assert "DMuon step 2" in text, text
        assert "over ranks [0, 1, 2]" in text, text
        # a rank either saw the connection close, or (waiting on a survivor that
        # already left) ran into DMuon's deadline — never the 60 s of the harness
        assert value["reason"] in ("peer_died", "timeout"), text
        if value["reason"] == "peer_died":
            assert f"rank {FAULTY} closed its connection" in text, text
        else:
            assert f"within {DMUON_TIMEOUT:g} s" in text, text
        # the roll call names the dead rank by number, on every survivor
        assert_names_the_dead_rank(value)


def test_a_rank_that_stops_answering_makes_the_others_raise_at_the_deadline():
    failure = outcomes(run_fault, "owner", "hang")
    # the others raise at DMuon's deadline, while the sleeper still sleeps
    assert failure.outcomes[FAULTY].status in ("raised", "killed")
    for value in survivors(failure):
        text = value["error"]
        assert value["reason"] == "timeout", text
        assert "DMuon step 2" in text and f"no answer within {DMUON_TIMEOUT:g} s" in text, text
        # every rank answered the roll call; the sleeper was in step 2 but in no collective
        assert value["dead_rank"] is None, text
        assert f"rank {FAULTY} (" in text and "alive but not in a DMuon collective" in text, text
        assert "'DMuon step 2'" in text, text


def run_pack_fault(rank: int, world: int):
    """Owner mode with the default packing (TanhNet's four small layers are one pack): the
    faulty rank dies in step 2 after the pack's reduction and step, before its
    publication; the others wait for the pack's broadcast in their next forward."""
    from dmuon.integrations import ddp

    model = TanhNet()
    ded = ddp.dedicate(model)
    opt = DMuon(
        param_groups(model),
        distributed=ded,
        **dict(OPT, timeout=WARMUP_TIMEOUT, store=rank_store()),
    )

    def before_publication() -> None:
        # the pack's key never reaches the real publish: no broadcast from this rank
        ded.exchange.publication.publish = faulty(lambda key: None, "kill", calls=1)

    return train_with_fault(rank, model, opt, before_publication, seed=rank)


def test_a_rank_killed_between_a_packs_reduction_and_its_publication():
    failure = outcomes(run_pack_fault)
    assert not failure.timed_out, str(failure)  # nobody hung until run_on_ranks' timeout
    assert failure.outcomes[FAULTY].status == "died"
    for value in survivors(failure):
        text = value["error"]
        # waiting for the pack's weights, named by its first and last layer
        assert "before layer 'blocks.0..head' runs" in text, text
        assert "waiting for the weights published by DMuon step 2" in text, text
        assert value["dead_rank"] == FAULTY, text


def run_single_tp_fault(rank: int, world: int):
    """``mode="single"`` on a tensor-parallel model: each rank steps its shards of the
    matrices split over the mesh, and the ranks agree on each step first (a NaN on one
    rank must skip everywhere). The faulty rank dies as step 2 starts, after its
    backward; the others are in that agreement's all-reduce."""
    model = nn.Sequential(nn.Linear(8, 6 * world), nn.Tanh(), nn.Linear(6 * world, 2))
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = DMuon(
        param_groups(model), mode="single", **dict(OPT, timeout=WARMUP_TIMEOUT, store=rank_store())
    )

    def at_step() -> None:
        opt.step = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)

    # the same batch on every rank, as under TP
    return train_with_fault(rank, model, opt, at_step, seed=0)


def test_single_mode_over_a_tensor_parallel_mesh_names_a_dead_rank():
    """Single mode runs collectives when its matrices are split over ranks, so its
    processes answer roll calls too (before, a responder started only when the engine's
    own world had several ranks, never in single mode: no survivor named the dead
    rank)."""
    failure = outcomes(run_single_tp_fault)
    assert not failure.timed_out, str(failure)
    assert failure.outcomes[FAULTY].status == "died"
    for value in survivors(failure):
        assert "DMuon step 2" in value["error"], value["error"]
        assert_names_the_dead_rank(value)
