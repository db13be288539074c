"""One step of :class:`~dmuon.optim.DMuon`, top to bottom: guards → engine → report.

:func:`run_step` is the whole of ``DMuon.step`` after the closure: it checks
nothing was dedicated behind the optimizer's back, agrees with every rank that the
gradients are finite (``nonfinite=``), lets the engine of the execution mode run
the step (:meth:`~dmuon.optim.engine.Engine.step`, which calls back
:func:`step_matrices` and :func:`step_scalars` through the
:class:`~dmuon.optim.engine.Stepper` protocol), compares the ranks' parameters
every ``check_every`` steps, and fills the :class:`~dmuon.optim.StepReport`.
Every collective of the step runs under ``timeout=``; a failed one calls the roll
(:mod:`dmuon.comm.roll_call`) and names the rank that stalled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dmuon.comm import CollectiveError, CommStats, collective_timeout
from dmuon.comm.roll_call import note_phase
from dmuon.optim.batches import Bucket, Sink, active_entries, step_bucket
from dmuon.optim.deadline import check_timeout
from dmuon.optim.engine.base import Engine, Stepper
from dmuon.optim.engine.exchange import any_dedicated, exchange_of
from dmuon.optim.engine.guards import (
    NONFINITE_POLICIES,
    GradientChangedError,
    GroupValues,
    GroupValuesError,
    NonFiniteGradientError,
    StepMismatchError,
    ThawedParameterError,
    agree_step,
    check_agreement,
)
from dmuon.optim.engine.report import StepReport
from dmuon.optim.engine.split_presence import GradientPresenceError
from dmuon.optim.engine.tensor_split import settle_pending_grads
from dmuon.optim.rules import get_rule
from dmuon.optim.scalar import get_scalar_rule
from dmuon.optim.sparse_gradients import SparseGradientError
from dmuon.optim.vote import SignVote

__all__ = ["check_guard_options", "run_step", "step_matrices", "step_scalars"]


def run_step(
    stepper: Stepper,
    engine: Engine,
    number: int,
    *,
    skip: bool = False,
    sparse: str | None = None,
    values: GroupValues | None = None,
    refused: BaseException | None = None,
    timeout: float | None,
    nonfinite: str | None,
    check_every: int | None,
    stepped: Callable[[], int],
) -> tuple[StepReport, bool]:
    """Step ``number`` of ``stepper`` by ``engine``: ``(report, whether it stepped)``.

    ``stepped()`` is called once the engine has stepped and returns the number of
    steps taken so far (for ``check_every``); a skipped step (``"skip_step"``) does
    not call it. ``skip``: the loss scaler found an Inf (on some rank, the same answer
    on every rank): agree on the step, finish its communication, step nothing.
    ``sparse``: this rank's first parameter with a sparse gradient, as errors name it
    (:meth:`~dmuon.optim.group_record.GroupRecord.check`); every rank refuses the step
    (:class:`~dmuon.optim.sparse_gradients.SparseGradientError`), none is left waiting.
    ``refused``: the error this rank's check of its groups raised; every rank refuses the
    step alike (this rank with ``refused``, the others with
    :class:`~dmuon.optim.engine.guards.GroupValuesError`). ``values``: this rank's group
    values, compared across ranks in the same agreement (a difference:
    :class:`~dmuon.optim.engine.guards.GroupValuesError` on every rank).
    """
    if engine.mode != "owner" and any_dedicated():  # no dedication in this process: none
        dedicated = next((e.name for e in engine.params if exchange_of(e.param)), None)
        if dedicated is not None:
            raise RuntimeError(
                f"parameter {dedicated!r} was dedicated to an owner after this optimizer "
                f"was built (mode {engine.mode!r}): the dedication now reduces its gradient "
                "to one rank and publishes its weight, which this optimizer does not know. "
                "Call dedicate() first, then build DMuon(..., distributed=ded)"
            )
    report = StepReport(engine.mode, engine.rank, engine.world_size)
    t0 = time.perf_counter()
    note_phase(f"DMuon step {number}")
    ran = False
    try:
        with collective_timeout(timeout):
            with report.phase("comm_wait"):  # the guards' flags are communication too
                # begins the step (Engine.begin_step), the flags carried in its first
                # collective where it has one (owner mode: the presence flags')
                finite = _agree(engine, nonfinite, number, skip, sparse, values, refused)
            if not finite:
                engine.skip_step()
            else:
                engine.set_step_number(number)
                with engine.products():  # no autotuner where ranks repeat a matrix's step
                    engine.step(stepper, report)
                ran = True
                taken = stepped()
                if check_every is not None and taken % check_every == 0:
                    check_agreement(engine)
    except CollectiveError as err:
        raise err.after_roll_call().with_context(
            f"DMuon step {number} (mode {engine.mode!r}, rank {engine.rank} of {engine.world_size})"
        ) from err
    note_phase(f"outside DMuon (forward, backward, user code), step {number} done")
    report.seconds["total"] = time.perf_counter() - t0
    return report, ran


def _agree(
    engine: Engine,
    nonfinite: str | None,
    number: int,
    skip: bool = False,
    sparse: str | None = None,
    values: GroupValues | None = None,
    refused: BaseException | None = None,
) -> bool:
    """Begin the step (:meth:`~dmuon.optim.engine.Engine.begin_step`) and agree with every
    rank on the step number, on a loss scaler's skip (``skip``: this rank's scaler found
    an Inf; any rank's skips every rank), on refusing a sparse gradient (``sparse``: this
    rank's), on refusing a group value (``refused``: this rank's error), on the group
    values (``values``) and whether all gradients are finite
    (:func:`~dmuon.optim.engine.agree_step`); raise, or say whether to step."""
    try:
        # a scaler's Inf is expected, not an error: no rank checks when any rank skips
        # (each rank's skip comes from the same agreed Inf flag of its ShardedGradScaler)
        check = nonfinite is not None and not skip
        ranks, names, skipping = agree_step(
            engine,
            number,
            check_finite=check,
            skip=skip,
            begin=True,
            sparse=sparse,
            values=values,
            refused=refused,
        )
    except (
        StepMismatchError,
        ThawedParameterError,
        GradientChangedError,
        SparseGradientError,
        GradientPresenceError,
        GroupValuesError,
    ):
        engine.skip_step()  # nothing in flight: the optimizer stays usable
        raise
    except BaseException as err:
        if err is refused:  # this rank's own refusal, agreed by every rank
            engine.skip_step()
        raise
    if skipping:  # some rank's loss scaler found an Inf: every rank skips
        return False
    if not ranks:
        return True
    if nonfinite == "skip_step":
        return False
    engine.skip_step()  # no collective left in flight: the optimizer stays usable
    here = f"; on this rank: {names[:5]}" if names else ""
    raise NonFiniteGradientError(
        f"DMuon step {number}: non-finite (NaN or Inf) gradient on rank(s) {ranks}{here}. "
        f"Nothing was updated on any rank (rank {engine.rank} of {engine.world_size}). "
        "Lower the learning rate or clip the gradients, or pass nonfinite='skip_step' to "
        "skip such steps on every rank (counted in skipped_steps)",
        ranks,
        names,
    )


def step_matrices(
    group: Mapping[str, Any],
    index: int,
    buckets: list[Bucket],
    state: Mapping[torch.Tensor, dict[str, Any]],
    report: StepReport,
    *,
    vote: SignVote,
    max_batch_elements: int | None,
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    sink: Sink | None = None,
) -> None:
    """Run matrix group ``index``'s rule on ``buckets`` (same-shape batches)."""
    if not buckets:
        return
    group = _read_tensors(group)
    # each bucket's entries with a gradient, listed once for the step (step_bucket's active)
    lists = [active_entries(b, grads) for b in buckets]
    active: dict[int, tuple[torch.Tensor, int]] = {}  # id → (parameter, index in its group)
    for entries in lists:
        for e in entries:
            active[id(e.param)] = (e.param, e.index)
    if not active:
        return
    torch._foreach_add_([state[p]["step"] for p, _ in active.values()], 1.0)
    rule = get_rule(group["rule"])
    names = group.get("param_names")
    timings: dict[str, float] = {}
    for b, entries in zip(buckets, lists, strict=True):
        ran = step_bucket(
            b,
            group,
            rule,
            state,
            vote,
            max_batch_elements,
            grads=grads,
            sink=sink,
            timings=timings,
            active=entries,
        )
        report.matrices += ran
        report.rule_calls += int(ran > 0)
    for phase, seconds in timings.items():
        report.add(phase, seconds)
    report.stepped.extend(
        names[i] if names else f"group{index}.param{i}" for _, i in active.values()
    )


def step_scalars(
    group: Mapping[str, Any],
    state: Mapping[torch.Tensor, dict[str, Any]],
    params: list[torch.Tensor] | None = None,
    stats: CommStats | None = None,
) -> None:
    """The group's scalar rule (AdamW/Lion) on ``params`` (default: the group's) that have a
    gradient; the pending sums of DTensor gradients carried out first are counted in
    ``stats`` (the engine's)."""
    candidates = group["params"] if params is None else params
    params = [p for p in candidates if p.grad is not None]
    if not params:
        return
    # a DTensor gradient's pending sums (Partial), carried out under the deadline; plain
    # gradients are looked at here, without a call per step into another module
    if any(type(p.grad) is not torch.Tensor for p in params):
        settle_pending_grads(params, stats)
    # a sparse gradient was refused before: by DMuon.step (GroupRecord.check, agreed by
    # every rank), by ZeroClientOptimizer.step for DeepSpeed's groups
    grads = [p.grad for p in params]
    get_scalar_rule(group["rule"]).update(
        params,
        grads,  # type: ignore[arg-type]
        [state[p] for p in params],
        _read_tensors(group),
    )


def _read_tensors(group: Mapping[str, Any]) -> Mapping[str, Any]:
    """``group`` with each value held as a one-element tensor (an ``lr`` tensor the caller
    changes in place, as ``torch.optim`` allows) read as a float now: the group keeps
    the caller's tensor (:func:`~dmuon.optim.hyperparameters.real`), so that every step
    reads its current value, checked by ``DMuon.step``'s
    :meth:`~dmuon.optim.group_record.GroupRecord.check` first."""
    read = {
        k: float(v)
        for k, v in group.items()
        if isinstance(v, torch.Tensor) and k != "params"  # params: a list, never a tensor
    }
    return {**group, **read} if read else group


def check_guard_options(timeout: Any, nonfinite: Any, check_every: Any, store: Any) -> None:
    """Raise on a bad ``timeout``, ``nonfinite``, ``check_every`` or ``store`` of ``DMuon``."""
    check_timeout(timeout)
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite must be 'raise', 'skip_step' or None (no check); got {nonfinite!r}"
        )
    if check_every is not None and (
        isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1
    ):
        raise ValueError(
            f"check_every must be an int ≥ 1 (compare parameters across ranks every that "
            f"many steps) or None (never); got {check_every!r}"
        )
    if store is not None and not isinstance(store, torch.distributed.Store):
        raise ValueError(
            "store must be a torch.distributed.Store (e.g. the TCPStore the process group "
            f"was initialised with) or None; got {type(store).__name__}"
        )
