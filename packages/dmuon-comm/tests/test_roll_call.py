"""dmuon.comm.roll_call: after a failed collective the survivors name the rank at fault.

Real processes, a real store. A rank that never starts its responder stands for a
dead one (a dead process cannot answer either); the killed-process case end to end
is tests-integration/test_timeouts.py.
"""

import os
import signal
import time

import pytest
import torch.distributed as dist

from dmuon.comm import CollectiveError
from dmuon.comm.roll_call import (
    RollCall,
    call_roll,
    note_collective,
    note_phase,
    responder_status,
    start_responder,
)
from dmuon.comm.testing import RankFailure, rank_store, run_on_ranks


def _silent_rank_is_absent(rank, world):
    if rank != 2:  # rank 2 never answers
        assert start_responder(rank_store())
        note_collective("broadcast from owners")
    dist.barrier()
    out = {}
    if rank == 0:
        roll = call_roll([0, 1, 2], grace=0.5)
        out = {"absent": roll.absent, "answered": sorted(roll.answers), "age": roll.age}
        out["pid_ok"] = roll.answers[1]["pid"] != os.getpid() and roll.answers[0]["pid"] == (
            os.getpid()
        )
        out["summary"] = roll.summary()
    dist.barrier()
    if rank == 1:  # the same failure seen later: rank 0's roll call is reused
        err = CollectiveError("broadcast", [0, 1, 2], 2.0, "timeout", "Operation timed out!")
        err = err.after_roll_call(grace=0.5).with_context("DMuon step 3")
        out = {
            "dead": err.dead_rank,
            "caller": err.roll_call.caller,
            "age": err.roll_call.age,
            "text": str(err),
        }
    dist.barrier()
    return out


def test_a_rank_that_does_not_answer_is_named_and_a_later_caller_reuses_the_roll():
    got = run_on_ranks(_silent_rank_is_absent, 3, timeout=60)
    first, later = got[0], got[1]
    assert first["absent"] == [2] and first["answered"] == [0, 1] and first["age"] == 0
    assert first["pid_ok"]
    assert first["summary"] == (
        "roll call over ranks [0, 1, 2]: rank 2 did not answer — its process is gone "
        "(killed, crashed or exited) or frozen"
    )
    assert later["dead"] == 2 and later["caller"] == 0 and later["age"] > 0
    assert later["text"].startswith("DMuon step 3: broadcast over ranks [0, 1, 2] failed")
    assert "rank 2 did not answer" in later["text"] and "called by rank 0" in later["text"]


def _stalled_rank_is_named(rank, world):
    assert start_responder(rank_store())
    if rank == 2:
        note_phase("DMuon step 5")
        note_collective(None)  # e.g. stuck computing inside the step
    else:
        note_collective("all-reduce of flags")
    dist.barrier()
    out = None
    if rank == 0:
        roll = call_roll([0, 1, 2], grace=2.0)
        out = (roll.absent, roll.stalled, roll.summary())
    dist.barrier()
    return out


def test_when_every_rank_answers_the_one_outside_any_collective_is_named():
    absent, stalled, summary = run_on_ranks(_stalled_rank_is_named, 3, timeout=60)[0]
    assert absent == [] and stalled == [2]
    assert "rank 2 (" in summary and "alive but not in a DMuon collective" in summary
    assert "'DMuon step 5'" in summary


def test_the_store_is_found_from_the_environment_and_its_loss_is_said():
    # rank 1 calls a roll through the env store; then the store's host dies
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_env_then_unavailable, 2, timeout=60)
    outcomes = info.value.outcomes
    assert outcomes[0].status == "died" and outcomes[0].exitcode == -signal.SIGKILL
    assert outcomes[1].status == "ok", outcomes[1].summary() + outcomes[1].traceback
    status, alive, after = outcomes[1].value
    assert "MASTER_ADDR:MASTER_PORT" in status
    assert alive == ([], [0, 1])
    assert after is not None and "may be the one that died" in after


def _env_then_unavailable(rank, world):
    if rank == 0:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        rank_store().set("port", str(server.port))
    port = rank_store().get("port").decode()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    assert start_responder()
    status = responder_status()
    note_collective("broadcast")
    dist.barrier()
    alive = None
    if rank == 1:
        roll = call_roll([0, 1], grace=2.0)
        alive = (roll.absent, sorted(roll.answers))
    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the store dies with its host
    time.sleep(0.3)
    roll = call_roll([0, 1], grace=0.5)  # never raises: says why there is no roll call
    return status, alive, roll.unavailable


_EXIT_SCRIPT = """
import os, sys, torch.distributed as dist
from dmuon.comm.roll_call import note_collective, start_responder
dist.init_process_group("gloo", init_method="env://")  # rank 0 hosts the TCPStore
assert start_responder(), "no responder from MASTER_ADDR/MASTER_PORT"
note_collective(None)
dist.barrier()
if sys.argv[1] == "destroy":  # the store's server goes away while others still poll
    dist.destroy_process_group()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("ending", ["exit", "destroy"])
def test_processes_with_a_responder_exit_cleanly(tmp_path, ending):
    # A responder blocked in a native store.wait aborted every process at exit
    # ("terminate called without an active exception") once rank 0's store went away.
    import socket
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), ending],
            env={
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0 and "exiting" in out, f"rank {rank}: rc {p.returncode}\n{err}"
        assert "terminate called" not in err, err


def test_ranks_waiting_in_different_dmuon_collectives_are_told_apart():
    """A rank that saved alone waits in the save's all-reduce while the others went on into
    their next step's: every rank answers from inside a DMuon collective, so none is
    stalled, but the summary says where each waits (it said only that every rank waited)."""
    answers = {
        0: {"phase": "DMuon checkpoint save", "collective": "all-reduce of steps"},
        1: {"phase": "DMuon step 3", "collective": "all-reduce of gradient-presence flags"},
        2: {"phase": "DMuon step 3", "collective": "all-reduce of gradient-presence flags"},
    }
    summary = RollCall([0, 1, 2], answers, [], [], caller=1).summary()
    assert "they wait in different DMuon collectives" in summary, summary
    assert "rank 0 in 'DMuon checkpoint save' (all-reduce of steps)" in summary, summary
    assert "ranks [1, 2] in 'DMuon step 3'" in summary, summary
    same = {r: answers[1] for r in (0, 1)}
    assert "every rank answered and was waiting in a DMuon collective" in (
        RollCall([0, 1], same, [], [], caller=0).summary()
    )
