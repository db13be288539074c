"""The deadline where waits do not block the host (NCCL), simulated on gloo.

On NCCL a timed ``work.wait(timeout=...)`` blocks the host until the collective is
done, draining the GPU queue; ``wait()`` only makes the stream wait. So where the result
is used by kernels next (the owner collectives, the vote, the buffers' broadcast: their
callers pass ``device=``) and the backend's waits are stream waits,
:func:`dmuon.comm.wait_work` leaves each work to the stream and records it, and the step
checks the deadline before its host reads of the agreement's flags
(:func:`dmuon.comm.faults.settle`). There is no NCCL here: each rank
makes its groups look like NCCL's (the backend map DMuon reads is monkeypatched), and

* with gloo's own (blocking) untimed wait as the "stream wait", owner mode steps
  bitwise as without the simulation — the record and its checks change no number;
* with a wait that gives up after a while, as a device that runs ahead does, a rank
  whose peer sleeps past the deadline before ``opt.step()`` raises
  :class:`~dmuon.comm.CollectiveError` at the step's agreement within the deadline (its
  flags are read on the host next, so their own wait stays timed).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from distributed_cases import TanhNet
from torch import nn

from dmuon.comm import CollectiveError
from dmuon.comm.testing import rank_store, run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 2
DMUON_TIMEOUT = 2.0
STALL = 5 * DMUON_TIMEOUT  # the stalled rank sleeps this long: well past the deadline
RUN_AHEAD_S = 0.5  # how long the simulated stream wait waits before it runs ahead


def _simulate_nccl() -> dict[str, int]:
    """Make every group's waits stream waits (as NCCL's); count what is recorded and
    how often the step settles."""
    from dmuon.comm import faults

    counts = {"recorded": 0, "settled": 0}
    faults._device_backends = lambda group: {"cuda": "nccl"}  # type: ignore[assignment]
    record, settle = faults._record, faults.settle

    def counting_record(entry):
        counts["recorded"] += 1
        record(entry)

    def counting_settle(**kwargs):
        counts["settled"] += 1
        settle(**kwargs)

    faults._record = counting_record  # type: ignore[assignment]
    from dmuon.optim.engine import guards, planned, reduction

    for module in (faults, guards, planned, reduction):
        module.settle = counting_settle  # type: ignore[attr-defined]
    return counts


def _build(model: nn.Module) -> DMuon:
    from dmuon.integrations import ddp

    return DMuon(
        param_groups(model),
        distributed=ddp.dedicate(model, layer_pack_mb=0),
        lr=0.02,
        ns_compute_dtype="float32",
        timeout=30.0,
        store=rank_store(),
    )


def run_steps(rank: int, world: int, simulate: bool) -> dict:
    counts = _simulate_nccl() if simulate else {}
    model = TanhNet()
    opt = _build(model)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, **counts}


def test_owner_steps_equal_bitwise_when_waits_are_left_to_the_stream():
    plain = run_on_ranks(run_steps, WORLD, args=(False,), timeout=120)
    streamed = run_on_ranks(run_steps, WORLD, args=(True,), timeout=120)
    for a, b in zip(plain, streamed, strict=True):
        assert b["recorded"] > 0 and b["settled"] >= 3, b  # the simulated path was taken
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), name


def run_stalled_peer(rank: int, world: int) -> dict:
    from dmuon.comm import faults

    _simulate_nccl()
    model = TanhNet()
    opt = _build(model)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 3):
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
        if step == 2:
            if rank == 1:
                time.sleep(STALL)  # never joins the step's agreement in time
                return {"stalled": True}
            opt.timeout = DMUON_TIMEOUT

            def run_ahead(work) -> None:
                # a device that runs ahead: the host does not wait for the collective
                until = time.monotonic() + RUN_AHEAD_S
                while not work.is_completed() and time.monotonic() < until:
                    time.sleep(0.001)

            faults._stream_wait = run_ahead  # type: ignore[assignment]
        t0 = time.monotonic()
        try:
            opt.step()
        except CollectiveError as err:
            return {
                "error": str(err),
                "reason": err.reason,
                "what": err.what,
                "seconds": time.monotonic() - t0,
            }
        opt.zero_grad()
    return {"error": None}


def test_a_peer_stalled_past_the_deadline_raises_at_the_steps_agreement():
    first, stalled = run_on_ranks(run_stalled_peer, WORLD, timeout=90)
    assert stalled == {"stalled": True}
    text = first["error"]
    assert text is not None, "rank 0 stepped without noticing its stalled peer"
    assert first["reason"] == "timeout", text
    assert "gradient-presence flags" in first["what"], text
    assert "DMuon step 2" in text and f"no answer within {DMUON_TIMEOUT:g} s" in text, text
    # the flags are read on the host next: their wait is a timed one on every backend
    # (no device= given), and the works left to the stream before it were settled
    # the deadline after the simulated run-ahead, and a roll call: well before the peer
    assert first["seconds"] < STALL - 2, first
    print(f"rank 0 raised {first['seconds']:.1f} s into step 2")
