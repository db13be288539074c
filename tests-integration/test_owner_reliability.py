"""Owner mode never hangs, never steps nothing in silence, never hands out stale weights.

Each case runs on real gloo ranks with a short DMuon ``timeout`` (3 s) under
``run_on_ranks``' own timeout, so a hang fails the test instead of stalling it:

* ZeRO-3-like (``reshard_after_forward=True``): the re-broadcast of freed weights in
  the backward pre-hook waits under DMuon's deadline, and the error names the rank
  that did not come (a rank that stalls in backward); a parameter used on one rank
  only is named on every rank at the end of the forward, before any re-broadcast;
* a step whose every micro-batch ran inside ``no_sync()`` raises on every rank
  instead of moving nothing;
* in default owner mode ``state_dict()`` taken while the owners' broadcasts are in
  flight waits for them, so it holds the weights of the step just taken.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from distributed_cases import TanhNet
from torch import nn

from dmuon.comm import CollectiveError
from dmuon.comm.testing import rank_store, run_on_ranks
from dmuon.integrations import PartialUseError
from dmuon.optim import DMuon, UnsyncedGradientsError, param_groups

WORLD = 2
DMUON_TIMEOUT = 3.0
STALL = 4 * DMUON_TIMEOUT  # the stalled rank sleeps this long: well past the deadline


def _optimizer(model: nn.Module, **dedicate_options):
    from dmuon.integrations import ddp

    ded = ddp.dedicate(model, **dedicate_options)
    opt = DMuon(
        param_groups(model),
        distributed=ded,
        lr=0.02,
        ns_compute_dtype="float32",
        timeout=DMUON_TIMEOUT,
        store=rank_store(),
    )
    return ded, opt


def _train_until_error(rank: int, forward, opt, steps: int = 3) -> dict:
    g = torch.Generator().manual_seed(rank)
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        x = torch.randn(4, 8, generator=g)
        try:
            F.mse_loss(forward(x, step), torch.zeros(4, 2)).backward()
            opt.step()
        except CollectiveError as err:
            return {"error": str(err), "reason": err.reason, "seconds": time.monotonic() - t0}
        except PartialUseError as err:
            return {"error": str(err), "names": err.names, "seconds": time.monotonic() - t0}
        opt.zero_grad()
    return {"error": None, "seconds": time.monotonic() - t0}


def run_used_on_rank_0_only(rank: int, world: int) -> dict:
    model = TanhNet(extra=True)
    _, opt = _optimizer(model, reshard_after_forward=True)
    return _train_until_error(rank, lambda x, _: model(x, use_extra=rank == 0), opt)


class Widening(nn.Module):
    """``wide → extra → head`` (8 → 32 → 32 → 2): three layers of three shapes."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.wide, self.extra, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.wide(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def run_used_on_rank_0_only_layer_by_layer(rank: int, world: int) -> dict:
    model = Widening()
    _, opt = _optimizer(model, reshard_after_forward=True, layer_pack_mb=0)
    try:
        return _train_until_error(rank, lambda x, _: model(x, use_extra=rank == 0), opt)
    except CollectiveError as err:  # in the forward, before the loop's try
        return {"error": str(err), "reason": err.reason, "seconds": 0.0}


def run_stall_in_backward(rank: int, world: int) -> dict:
    model = TanhNet(extra=True)
    _, opt = _optimizer(model, reshard_after_forward=True)

    def stall(*_):
        time.sleep(STALL)

    if rank == 1:  # fires before the blocks' backward pre-hooks
        model.head.register_full_backward_hook(stall)
    return _train_until_error(rank, lambda x, _: model(x), opt, steps=1)


def _ok_values(fn) -> list[dict]:
    # a hang fails here as RankFailure ("still running at the 90 s timeout")
    return run_on_ranks(fn, WORLD, timeout=90)


@pytest.mark.timeout(150)
def test_zero3_parameter_used_on_one_rank_raises_on_every_rank_within_the_deadline():
    values = _ok_values(run_used_on_rank_0_only)
    for rank, v in enumerate(values):
        assert v["error"] is not None, f"rank {rank} trained on without noticing: {v}"
        assert v["seconds"] < DMUON_TIMEOUT, v  # at the end of the forward, no deadline
        assert v.get("names") == ["extra.weight"], v  # PartialUseError, on every rank
        assert "reshard_after_forward=True" in v["error"], v["error"]


@pytest.mark.timeout(150)
def test_zero3_layer_on_one_rank_whose_forward_waits_for_it_is_named_at_the_deadline():
    """Every layer its own broadcast (``layer_pack_mb=0``): rank 0's forward waits for
    ``extra``'s weights, which rank 1 never re-gathers, so the check at the end of the
    forward is never reached there. At the deadline rank 0 says where it waits and why
    under ``reshard_after_forward``; the roll call shows rank 1 elsewhere (at the check,
    which names the forward as where the missing rank is)."""
    v = _ok_values(run_used_on_rank_0_only_layer_by_layer)
    mine, other = v[0]["error"], v[1]["error"]
    assert mine is not None and "before layer 'extra' runs" in mine, mine
    assert "a layer run on some ranks only" in mine, mine
    assert "rank 1" in mine.split("oll call")[1], mine  # the roll call names it
    assert other is not None and "parameter-use flags" in other, other


@pytest.mark.timeout(150)
def test_zero3_rank_stalled_in_backward_is_named_by_the_others():
    values = _ok_values(run_stall_in_backward)
    v = values[0]
    assert v["error"] is not None, f"rank 0 waited {v['seconds']:.0f} s without an error"
    assert v["reason"] == "timeout", v["error"]
    assert f"within {DMUON_TIMEOUT:g} s" in v["error"], v["error"]
    assert "rank 1 (" in v["error"] and "alive but not in a DMuon collective" in v["error"], v[
        "error"
    ]
    assert v["seconds"] < STALL, v


def run_every_micro_batch_in_no_sync(rank: int, world: int) -> dict:
    model = TanhNet(extra=True)
    ded, opt = _optimizer(model)
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        with ded.no_sync():
            F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
    try:
        opt.step()
    except UnsyncedGradientsError as err:
        moved = sum(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        # the error leaves the locally accumulated gradients alone: the run can go on
        held = all(p.grad is not None for p in model.parameters())
        # ... and the exchange: the next (synchronised) step works
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
        opt.step()
        return {"error": str(err), "moved": moved, "held": held, "stepped": True}
    return {"error": None}


@pytest.mark.timeout(150)
def test_a_step_after_only_no_sync_micro_batches_raises_on_every_rank():
    for v in _ok_values(run_every_micro_batch_in_no_sync):
        assert v["error"] is not None, "the step moved nothing and said nothing"
        assert "no_sync()" in v["error"] and "outside no_sync()" in v["error"], v["error"]
        assert v["moved"] == 0 and v["held"] and v["stepped"], v


def _slow(matrix_step):
    def step(*args, **kwargs):
        time.sleep(0.5)
        matrix_step(*args, **kwargs)

    return step


def run_state_dict_right_after_step(rank: int, world: int) -> dict:
    model = TanhNet(extra=True)
    ded, opt = _optimizer(model)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        if rank == 1 and step == 1:  # rank 1 publishes late: rank 0 reads before it arrives
            opt.step_matrices = _slow(opt.step_matrices)
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
        opt.step()
        opt.zero_grad()
    early = {k: v.clone() for k, v in model.state_dict().items()}  # broadcasts in flight
    ded.wait()
    late = model.state_dict()
    stale = [k for k in late if not torch.equal(early[k], late[k])]
    return {"stale": stale, "pending": opt.engine.exchange.publication.pending_publications()}


@pytest.mark.timeout(150)
def test_state_dict_with_broadcasts_in_flight_holds_the_new_weights():
    for v in _ok_values(run_state_dict_right_after_step):
        assert v["stale"] == [], f"state_dict() returned weights one step old: {v['stale']}"
        assert v["pending"] == [], v


def _dedicate_alone(rank: int, world: int):
    import dmuon.optim.deadline as deadline
    from dmuon.integrations import ddp

    deadline.AUTO_FLOOR_SECONDS = DMUON_TIMEOUT  # the default deadline, lowered for the test
    if rank == 1:  # never dedicates (another branch), then leaves
        time.sleep(STALL)
        raise SystemExit("the absent rank gives up")
    try:
        ddp.dedicate(TanhNet(extra=True))
    except CollectiveError as err:
        return {"error": str(err), "reason": err.reason}
    return {"error": None}


def test_dedicate_waits_for_the_other_ranks_under_the_default_deadline():
    # dedicate() runs before any DMuon(timeout=) exists: its broadcasts wait under the
    # floor of timeout="auto" (300 s; lowered here), not the process group's 30 minutes
    from dmuon.comm.testing import RankFailure

    with pytest.raises(RankFailure) as info:
        run_on_ranks(_dedicate_alone, WORLD, timeout=60)
    failure = info.value
    assert not failure.timed_out, str(failure)
    alone = failure.outcomes[0]
    assert alone.status == "ok", f"rank 0: {alone.summary()}\n{alone.traceback}"
    text = alone.value["error"]
    assert text is not None and alone.value["reason"] == "timeout", text
    assert "dedicate()" in text and f"no answer within {DMUON_TIMEOUT:g} s" in text, text
