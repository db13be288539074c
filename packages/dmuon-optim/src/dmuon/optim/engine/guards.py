"""Guards around a step: non-finite gradients, and ranks whose parameters diverged.

Both are decided by *every* rank together, with one small collective each, so no
rank goes on alone (a rank that skipped a step while the others stepped would hang
the next collective, or silently train another model).

* **Non-finite gradients** (:func:`nonfinite_ranks`): each rank takes the largest
  absolute value of each gradient it holds (``inf``-norm: it never overflows, and
  NaN propagates through it), sets its own slot of a flag vector, and the vector is
  summed over the engine's groups. In owner mode this runs after the reductions were
  launched but before their results are used, on the *local* gradients: a NaN on
  rank 1 is seen by every rank before it reaches any owner's momentum.
* **Step agreement** (the same flag vector): each rank's slot also carries the number
  of the step its optimizer is at. Ranks whose optimizers counted differently (one
  rebuilt or resumed apart from the others) see it and raise
  :class:`StepMismatchError` before any collective of the step proper is entered. A
  rank that merely skips ``opt.step()`` is not caught by the number (its next step
  meets the others' current one, both counted alike) but by its absence: in the
  modes whose process group the training framework also uses (``replicated``:
  DDP's, ``sharded``: FSDP2's, and ``sign``), the vector is summed over a twin of
  each group (:func:`guard_groups`), so it never meets a collective of another size
  that a skipping rank entered instead; the rank that waits raises
  :class:`dmuon.comm.CollectiveError` at the deadline, naming the rank that is
  elsewhere, and no backend aborts on a mismatch.
* **Changed gradients** (the same flag vector): in owner mode a gradient leaves for
  its owner as backward produces it; a rank whose training loop changed one afterwards
  (:meth:`Engine.changed_gradients`, seen by the gradient's version counter) sets a
  bit, and every rank raises :class:`GradientChangedError` before anything is updated.
* **Weights written during publication** (the same flag vector): in owner mode the
  stepped weights are broadcast from their owners after ``step()``; a rank that wrote a
  dedicated weight before that broadcast was waited for (``Dedication.wait()``, or the
  layer's forward pre-hook) lost the write on some ranks
  (:meth:`~dmuon.optim.engine.Publication.written_weights`) and sets a bit, and every
  rank raises :class:`RankDivergenceError` naming the parameters and ranks before
  anything is updated.
* **Group values** (the same all-reduce, four slots more): a value a rank's ``step()``
  refused (:meth:`~dmuon.optim.group_record.GroupRecord.check`: ``momentum=1.5`` set on
  one rank) sets that rank's slot to ``-2``, and every rank raises before any collective
  of the step proper, as for a sparse gradient; and a fingerprint of each rank's checked
  group values (:class:`GroupValues`) is summed with its square, so that ranks holding
  different values (a scheduler stepped on one rank only) raise
  :class:`GroupValuesError` on every rank instead of stepping each matrix with its
  owner's learning rate.
* **Rank agreement** (:func:`check_agreement`): a checksum per parameter — the
  integer sum of its bit patterns, so any flipped bit in one element changes it —
  all-gathered and compared. Parameters sharded by FSDP2 differ by design and are
  left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import wait_work
from dmuon.comm.faults import settle, stream_waits
from dmuon.comm.flags import flag_device
from dmuon.comm.objects import all_gather_objects
from dmuon.comm.process_groups import twin_groups
from dmuon.comm.torch_compat import all_gather_single
from dmuon.optim.engine.base import Engine
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.split_presence import presence_error
from dmuon.optim.sparse_gradients import first_sparse, sparse_gradient_error

__all__ = [
    "NONFINITE_POLICIES",
    "GradientChangedError",
    "GroupValues",
    "GroupValuesError",
    "NonFiniteGradientError",
    "RankDivergenceError",
    "StaleGradientError",
    "StepMismatchError",
    "ThawedParameterError",
    "agree_step",
    "check_agreement",
    "guard_groups",
    "nonfinite_ranks",
]

NONFINITE_POLICIES = ("raise", "skip_step", None)


class _FoundOnRanks(RuntimeError):
    """An error the step's agreement raises on every rank: its message, the ranks where
    the fault was found, and the parameters at fault on this rank."""

    def __init__(self, message: str, ranks: list[int], names: list[str]) -> None:
        super().__init__(message)
        self.ranks, self.names = ranks, names


class NonFiniteGradientError(_FoundOnRanks):
    """A gradient holds NaN or Inf on some rank (raised on every rank, state untouched).

    Attributes:
        ranks: the ranks whose gradients are not finite.
        names: the parameters with a non-finite gradient on this rank.

    Examples:
        >>> err = NonFiniteGradientError("nan", [1], [])
        >>> err.ranks
        [1]
    """


class GradientChangedError(_FoundOnRanks):
    """A gradient was changed after the engine had taken it for a collective (owner mode:
    reduced to its owner during backward), so the change would be lost. Raised on every
    rank by the step's agreement, before anything was updated.

    Attributes:
        ranks: the ranks where a gradient was changed.
        names: the parameters whose gradient this rank changed.

    Examples:
        >>> GradientChangedError("changed", [0], ["w"]).names
        ['w']
    """


class StaleGradientError(_FoundOnRanks):
    """A gradient was still the averaged one the last step left on its owner, not zeroed
    since: this step's backward added to it, or ``step()`` came again without a backward
    (owner mode). Only the owner held that average, so the reduction would average it
    with the other ranks' new gradients as if it were the owner's own (``avg₁/N + avg₂``
    where one process steps with ``avg₁ + avg₂``). Raised on every rank by the step's
    agreement, before anything was updated.

    Attributes:
        ranks: the ranks where such a gradient was found.
        names: the parameters found on this rank.

    Examples:
        >>> StaleGradientError("stale", [0], ["w"]).names
        ['w']
    """


class ThawedParameterError(_FoundOnRanks):
    """A parameter that did not require a gradient when the optimizer was built holds one
    at a step (:meth:`Engine.thawed`): the distributed modes planned without it, so
    nothing would average its gradient or step it alike. Raised on every rank by the
    step's agreement, before anything was updated.

    Attributes:
        ranks: the ranks where such a parameter holds a gradient.
        names: those parameters on this rank.

    Examples:
        >>> ThawedParameterError("thawed", [1], []).ranks
        [1]
    """


class GroupValuesError(_FoundOnRanks, ValueError):
    """The ranks' parameter groups disagree: a value was refused on some rank(s) only, or
    the ranks hold different checked values (an ``lr`` a scheduler set on one rank only).
    Raised on every rank by the step's agreement, before anything was updated (a rank
    that refused a value raises that value's own error instead).

    Attributes:
        ranks: the ranks that refused a value, or whose values differ from the lowest
            rank's.
        names: the differing values, as ``"group0.lr"`` (empty for a refusal).

    Examples:
        >>> GroupValuesError("differ", [1], ["group0.lr"]).names
        ['group0.lr']
    """


@dataclass(frozen=True)
class GroupValues:
    """This rank's checked group values, as the step's agreement compares them.

    Attributes:
        fingerprint: a 64-bit digest of every group's checked values (equal values give
            the same digest on every rank).
        describe: every group's index on this rank and values by key, under a label
            that is the same on every rank (its parameter names' digest, else its
            index), gathered only when the fingerprints differ, to name the group, the
            key and the ranks.

    Examples:
        >>> GroupValues(7, lambda: {"group0": (0, {"lr": 0.02})}).describe()
        {'group0': (0, {'lr': 0.02})}
    """

    fingerprint: int
    describe: Callable[[], Mapping[str, tuple[int, Mapping[str, Any]]]]


class RankDivergenceError(RuntimeError):
    """Parameters that should be identical on every rank differ (raised on every rank).

    Attributes:
        names: the parameters that differ.
        ranks: for each, the ranks whose copy differs from rank 0's (a dedicated weight
            written while owner mode published it, which the step's agreement refuses
            before the copies drift apart: the ranks that wrote it).

    Examples:
        >>> RankDivergenceError("differ", ["w"], [[1]]).names
        ['w']
    """

    def __init__(self, message: str, names: list[str], ranks: list[list[int]]) -> None:
        super().__init__(message)
        self.names, self.ranks = names, ranks


class StepMismatchError(RuntimeError):
    """The ranks' optimizers are at different step numbers (one rebuilt or resumed apart).

    Raised on every rank that took part, before anything of the step was updated.

    Attributes:
        steps: each rank's step number (rank → step).

    Examples:
        >>> StepMismatchError("differ", {0: 3, 1: 2}).steps
        {0: 3, 1: 2}
    """

    def __init__(self, message: str, steps: dict[int, int]) -> None:
        super().__init__(message)
        self.steps = steps


def guard_groups(groups: list[dist.ProcessGroup | None]) -> list[dist.ProcessGroup | None]:
    """A twin of each group (same ranks, its own communicator) for the guards' flags,
    each set of ranks once.

    The flags are all-reduced over the groups in turn, so a group listed twice (a
    replicated mode's ``tp`` dimension that splits a matrix and holds the experts too)
    would count every rank's slot twice: its bits shifted (a non-finite flag read as a
    changed gradient) and the group values' sums off. Only the members of a group
    create its twin (``use_local_synchronization``), so every rank calls this once, at
    construction, for its own groups.
    """
    distinct: list[dist.ProcessGroup | None] = []
    seen: set[tuple[int, ...]] = set()
    for g in groups:
        ranks = tuple(dist.get_process_group_ranks(dist.group.WORLD if g is None else g))
        if ranks not in seen:
            seen.add(ranks)
            distinct.append(g)
    return twin_groups(distinct)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _global_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def nonfinite_ranks(engine: Engine) -> tuple[list[int], list[str]]:
    """Ranks holding a non-finite gradient (agreed by all), and this rank's bad parameters.

    Every rank of ``engine``'s groups must call it at the same point of the step.

    Raises:
        SparseGradientError: a gradient on some rank is sparse (on every rank, agreed in
            the collective: the rank that holds it names the parameter).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> w = torch.nn.Parameter(torch.ones(2, 2))
        >>> opt = DMuon([w])
        >>> w.grad = torch.full((2, 2), float("nan"))
        >>> nonfinite_ranks(opt.engine)
        ([0], ['group0.param0'])
    """
    # the refusal of a sparse gradient is agreed in the flags, as in DMuon.step: no rank
    # waits in the all-reduce for one that raised
    ranks, names, _ = agree_step(engine, None, check_finite=True, sparse=_sparse_name(engine))
    return ranks, names


# The bits of a rank's slot under the step number (64·number + …, see agree_step); a
# sparse gradient's refusal sets the slot to -1, a refused group value to -2, which no
# number gives.
NONFINITE, CHANGED, SKIP, THAWED, MISSING, STALE, WRITTEN, NUMBER = 1, 2, 4, 8, 16, 32, 64, 128
SPARSE, REFUSED = -1, -2
# after the world's slots: Σa, Σa², Σb, Σb² of two 21-bit pieces of each rank's
# fingerprint (a, b ∈ [1, 2²¹]): all ranks equal iff n·Σa² = (Σa)² and the same for b
# (Cauchy–Schwarz), with n·a² < 2⁶³ for any n < 2²¹ ranks: four slots, whatever the world
VALUE_SLOTS, _PIECE = 4, (1 << 21) - 1


def _pieces(fingerprint: int) -> tuple[int, int]:
    return (fingerprint & _PIECE) + 1, ((fingerprint >> 21) & _PIECE) + 1


class _Local:
    """What this rank brings to the step's agreement (read once, see :func:`agree_step`)."""

    def __init__(
        self,
        engine: Engine,
        number: int | None,
        *,
        check_finite: bool,
        skip: bool,
        sparse: str | None,
        vouched: frozenset[int] = frozenset(),
        values: GroupValues | None = None,
        refused: BaseException | None = None,
    ) -> None:
        # this rank's first parameter with a sparse gradient: its slot is then -1
        self.sparse = sparse
        self.refused, self.values = refused, values  # a refused value: its slot is -2
        # a sparse gradient cannot be summed; a refused step reads nothing more
        finite = check_finite and self.sparse is None and refused is None
        self.bad = _nonfinite_names(engine, vouched) if finite else []
        self.changed = engine.changed_gradients()
        self.stale = engine.stale_gradients()
        self.thawed = engine.thawed()
        self.missing = engine.missing_gradients()
        # owner mode's weights written while their publication was in flight; only an
        # engine that publishes weights has the method (OwnerEngine)
        written = getattr(engine, "written_weights", None)
        self.written: list[str] = written() if written is not None else []
        self.skip = skip
        self.slot = (
            REFUSED
            if refused is not None
            else SPARSE
            if self.sparse is not None
            else (
                NUMBER * (number or 0)
                + WRITTEN * int(bool(self.written))
                + STALE * int(bool(self.stale))
                + MISSING * int(bool(self.missing))
                + THAWED * int(bool(self.thawed))
                + SKIP * int(skip)
                + CHANGED * int(bool(self.changed))
                + NONFINITE * int(bool(self.bad))
            )
        )

    def slots(self, device: torch.device | None = None) -> torch.Tensor:
        """One ``int64`` slot per rank of the world, this rank's set, the others zero; then
        :data:`VALUE_SLOTS` for the group values' fingerprint (zero without ``values``).
        On ``device`` (the host by default)."""
        rank, world = _global_rank()
        flags = torch.zeros(world + VALUE_SLOTS, dtype=torch.int64)
        flags[rank] = self.slot
        if self.values is not None and self.refused is None:
            a, b = _pieces(self.values.fingerprint)
            flags[world:] = torch.tensor([a, a * a, b, b * b], dtype=torch.int64)
        return flags if device is None else flags.to(device)


def _sparse_name(engine: Engine) -> str | None:
    """The first parameter with a sparse gradient on this rank, as errors name it."""
    params = engine.params
    i = first_sparse(e.param.grad for e in params)
    return (
        None
        if i is None
        else f"parameter {params[i].name!r} (shape {tuple(params[i].param.shape)})"
    )


def agree_step(
    engine: Engine,
    number: int | None,
    *,
    check_finite: bool,
    skip: bool = False,
    begin: bool = False,
    sparse: str | None = None,
    values: GroupValues | None = None,
    refused: BaseException | None = None,
) -> tuple[list[int], list[str], list[int]]:
    """Agree with every rank on the step number and (``check_finite``) finiteness.

    One all-reduce of one ``int64`` slot per rank: ``128·number + (64 if this rank wrote
    a dedicated weight while its publication was in flight, owner mode's
    ``written_weights``) + (32 if this rank's
    launch found the averaged gradient the last step left on it not zeroed since,
    :meth:`Engine.stale_gradients`) + (16 if this rank found
    a tensor-parallel gradient missing on some ranks of its group,
    :meth:`Engine.missing_gradients`) + (8 if a parameter
    frozen when the optimizer was built holds a gradient here) + (4 if this rank asks to
    skip the step) + (2 if it changed a gradient after the engine took it) + (1 if it
    holds a non-finite gradient)``, summed over :meth:`Engine.guard_groups`. ``skip``:
    a loss scaler found an Inf (:mod:`dmuon.optim.loss_scaling`); any rank's skip is
    every rank's. ``sparse``: this rank's first parameter with a sparse gradient, as
    errors name it (``DMuon.step``: :meth:`~dmuon.optim.group_record.GroupRecord.check`;
    :func:`nonfinite_ranks`); its slot is then ``-1``, and every rank raises.
    ``refused``: the error this rank's check of its groups raised (``DMuon.step``:
    :meth:`~dmuon.optim.group_record.GroupRecord.check`); its slot is then ``-2``, and
    every rank raises — this rank ``refused`` itself, the others a
    :class:`GroupValuesError` with its message (a rank raising alone would leave the
    others waiting in the step's first collective). ``values``: this rank's group values
    (:class:`GroupValues`), compared in :data:`VALUE_SLOTS` more slots of the same
    all-reduce (no collective more a step; an error gathers the values to name them).

    ``begin``: begin the step too (:meth:`Engine.begin_step`). An engine whose first
    collective of the step can carry the slots (owner mode: the gradient-presence flags'
    all-reduce, :meth:`~dmuon.optim.engine.reduction.Reduction.flush`) sums them in it
    (:meth:`Engine.begin_step_agreeing`), so the step makes one small all-reduce, not two;
    this rank's slot is then read just before that collective, on the same local
    gradients the agreement read after it (the launches it is followed by take the
    gradients as they are; under ``free_local_grads`` they release them, and those are
    left out as they were). The gradients a launch in backward has proven finite (their
    bucket's sum at the copy, :meth:`~dmuon.optim.engine.reduction.Reduction.finite_at_launch`)
    are not read again: the non-finite check reads the rest. Any other engine begins first
    and the slots travel after.

    Returns:
        The ranks holding a non-finite gradient, this rank's bad parameters, and the
        ranks that asked to skip.

    Raises:
        StepMismatchError: the ranks are at different step numbers (on every rank).
        GradientPresenceError: a rank found a tensor-parallel gradient on some ranks of
            its group only (:meth:`Engine.missing_gradients`; on every rank).
        ThawedParameterError: a rank holds a gradient of a parameter frozen when the
            optimizer was built (:meth:`Engine.thawed`; on every rank).
        RankDivergenceError: a rank wrote a dedicated weight while its publication was
            in flight (owner mode; on every rank, naming the parameters and ranks).
        GradientChangedError: a rank changed a gradient after the engine had taken it
            (:meth:`Engine.changed_gradients`; on every rank).
        StaleGradientError: a rank's gradient was still the averaged one the last step
            left on it (:meth:`Engine.stale_gradients`; on every rank).
        SparseGradientError: a rank holds a sparse gradient (``sparse``; on every rank).
        GroupValuesError: a rank refused a group value (``refused``; that rank raises
            ``refused``), or the ranks' ``values`` differ (on every rank).
    """

    def read(vouched: frozenset[int] = frozenset()) -> _Local:
        return _Local(
            engine,
            number,
            check_finite=check_finite,
            skip=skip,
            sparse=sparse,
            vouched=vouched,
            values=values,
            refused=refused,
        )

    world = _global_rank()[1]
    groups = [g for g in engine.guard_groups() if g is not None or world > 1]
    mine: _Local | None = None
    summed: torch.Tensor | None = None
    if begin and groups:

        def carried(vouched: frozenset[int]) -> torch.Tensor:
            nonlocal mine
            mine = read(vouched)
            return mine.slots()  # on the host: the engine moves them where its group takes them

        summed = engine.begin_step_agreeing(carried)
    elif begin:
        engine.begin_step()
    if summed is None or mine is None:  # not carried: read after the begin, as always
        mine = read()
    if not groups:
        if refused is not None:
            raise refused
        if mine.sparse is not None:
            raise sparse_gradient_error(mine.sparse)
        if mine.missing:
            raise presence_error([engine.rank], mine.missing)
        if mine.thawed:
            raise _thawed_error([engine.rank], mine.thawed, engine, number)
        if mine.written:
            raise _written_error({engine.rank: mine.written}, number)
        if mine.changed:
            raise _changed_error([engine.rank], mine.changed, engine)
        if mine.stale:
            raise _stale_error([engine.rank], mine.stale)
        bad = mine.bad
        return ([engine.rank] if bad else []), bad, ([engine.rank] if skip else [])
    if summed is None:
        flags = mine.slots(flag_device(groups[0]))
        what = "all-reduce of step numbers, thawed, skip, changed-gradient and non-finite flags"
        for g in groups:
            wait_work(dist.all_reduce(flags, group=g, async_op=True), what, g)
        summed = flags
        # the deadline of the collectives left to the stream (NCCL), checked before the
        # host read; waited for when the flags' all-reduce was (the read waits anyway)
        settle(wait=any(stream_waits(g, flags.device) for g in groups))
    else:  # the flush read the carried slots (on the host now), settling first
        settle(wait=False)
    world = summed.numel() - VALUE_SLOTS
    *slots, sum_a, sum_a2, sum_b, sum_b2 = summed.tolist()
    refusing = [r for r, v in enumerate(slots) if v == REFUSED]
    if refusing:
        raise _refusal(refused, refusing, groups)
    refusing = [r for r, v in enumerate(slots) if v == SPARSE]
    if refusing:
        here = f"{mine.sparse} on rank(s) {refusing}" if mine.sparse else None
        raise sparse_gradient_error(here or f"a parameter on rank(s) {refusing}")
    steps = {r: v // NUMBER for r, v in enumerate(slots) if v}  # every rank of the groups
    if number is not None and len(set(steps.values())) > 1:
        at = ", ".join(f"rank {r} at step {n}" for r, n in steps.items())
        raise StepMismatchError(
            f"the ranks are at different DMuon steps ({at}): their optimizers counted "
            "different numbers of steps (one was rebuilt or resumed apart from the others, "
            "or its steps_taken was changed). Build, resume and step the optimizer the same "
            "way on every rank; to skip an iteration, skip it on every rank (e.g. nonfinite="
            "'skip_step' skips a step with a NaN/Inf gradient on any rank everywhere)",
            steps,
        )
    n = len(steps)
    if values is not None and (n * sum_a2 != sum_a * sum_a or n * sum_b2 != sum_b * sum_b):
        raise _values_error(values, groups, world)
    missing_ranks = [r for r, v in enumerate(slots) if v & MISSING]
    if missing_ranks:
        raise presence_error(missing_ranks, mine.missing)
    thawed_ranks = [r for r, v in enumerate(slots) if v & THAWED]
    if thawed_ranks:
        raise _thawed_error(thawed_ranks, mine.thawed, engine, number)
    if any(v & WRITTEN for v in slots):
        # every rank reached here from the same summed slots: gather the names
        raise _written_error(_gathered(mine.written, groups), number)
    changed_ranks = [r for r, v in enumerate(slots) if v & CHANGED]
    if changed_ranks:
        raise _changed_error(changed_ranks, mine.changed, engine)
    stale_ranks = [r for r, v in enumerate(slots) if v & STALE]
    if stale_ranks:
        raise _stale_error(stale_ranks, mine.stale)
    skipping = [r for r, v in enumerate(slots) if v & SKIP]
    return [r for r, v in enumerate(slots) if v & NONFINITE], mine.bad, skipping


def _gathered(obj: Any, groups: Sequence[dist.ProcessGroup | None]) -> dict[int, Any]:
    """Every rank's ``obj`` over the agreement's groups, by global rank (an error path:
    every rank of the groups reached it from the same summed slots)."""
    rank = _global_rank()[0]
    out: dict[int, Any] = {}
    for g in groups:
        out.update(all_gather_objects((rank, obj), g))
    return out


def _refusal(
    refused: BaseException | None, ranks: list[int], groups: Sequence[dist.ProcessGroup | None]
) -> BaseException:
    """The error of a step some rank(s) refused a group value of: this rank's own, or one
    naming the refusing ranks and (gathered) their message."""
    said = _gathered(None if refused is None else str(refused), groups)
    if refused is not None:
        return refused
    message = next((said[r] for r in ranks if said.get(r)), None)
    gist = f": {message}" if message else ""
    return GroupValuesError(
        f"DMuon step refused on every rank: rank(s) {ranks} refused a parameter group's "
        f"value{gist}. Nothing was updated on any rank; set the value on every rank alike "
        f"(and fix it there), {_NEXT}",
        ranks,
        [],
    )


# what a refused step leaves to do: replicated and sharded modes may step again on the
# same gradients; owner mode reduced them to their owners during backward (spent)
_NEXT = (
    "then run the next iteration (in owner mode this step's gradients were spent in their "
    "reductions: zero_grad() and a new backward first)"
)


def _values_error(
    values: GroupValues, groups: Sequence[dist.ProcessGroup | None], world: int
) -> GroupValuesError:
    """The ranks' group values differ: gather them to name the groups, keys and ranks."""
    described = _gathered(values.describe(), groups)
    first = min(described)
    base = described[first]
    differing: dict[str, list[int]] = {}
    shown: dict[str, str] = {}
    for r in sorted(described):
        theirs = described[r]
        for label in sorted(set(base) | set(theirs)):
            index, a = base.get(label, (None, {}))
            other, b = theirs.get(label, (None, {}))
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    name = f"group{other if index is None else index}.{key}"
                    differing.setdefault(name, []).append(r)
                    shown.setdefault(name, f"rank {first}: {a.get(key)!r}")
                    shown[name] += f", rank {r}: {b.get(key)!r}"
    labelled = {r: sorted(d) for r, d in described.items()}
    if any(labels != labelled[first] for labels in labelled.values()):
        # the groups are told apart by their parameters' names, where a group has them:
        # one rank's groups with ``param_names`` and another's without cannot be matched
        named = sorted(r for r, d in described.items() if not all(k.startswith("group") for k in d))
        unnamed = sorted(set(described) - set(named))
        if named and unnamed:
            why = f"rank(s) {named} give their groups 'param_names', rank(s) {unnamed} do not"
        else:
            unnamed = sorted(r for r, labels in labelled.items() if labels != labelled[first])
            why = f"rank(s) {unnamed} hold groups of other parameters than rank {first}"
        return GroupValuesError(
            f"DMuon step refused on every rank: the ranks' parameter groups cannot be matched: "
            f"{why}. Build the param groups the same way on every rank (e.g. "
            "dmuon.optim.param_groups(model) everywhere); nothing was updated on any rank, "
            f"{_NEXT}",
            unnamed,
            [],
        )
    ranks = sorted({r for rs in differing.values() for r in rs})
    if not differing:  # a rank outside the gathered groups' reach (or a digest collision)
        what = f"the ranks' checked group values differ (world of {world})"
    else:
        what = "; ".join(
            f"param group {name.split('.')[0][5:]} {name.split('.', 1)[1]!r} ({shown[name]})"
            for name in list(differing)[:5]
        )
    return GroupValuesError(
        f"DMuon step refused on every rank: the ranks' parameter groups hold different "
        f"values: {what}. A value set on some ranks only (a scheduler stepped on one rank, "
        "ReduceLROnPlateau fed a rank's local loss) would step each matrix with whichever "
        "rank's value steps it; nothing was updated on any rank. Set group values alike on "
        f"every rank (step schedulers on every rank, with an agreed metric), {_NEXT}",
        ranks,
        list(differing),
    )


def _on_this_rank(names: list[str], shown: int = 3) -> str:
    """``; on this rank: [the first names]`` for an error, saying how many more the
    error's ``names`` hold (``""`` for none)."""
    if not names:
        return ""
    more = f" and {len(names) - shown} more (the error's .names lists all)"
    return f"; on this rank: {names[:shown]}{more if len(names) > shown else ''}"


def _thawed_error(
    ranks: list[int], names: list[str], engine: Engine, number: int | None
) -> ThawedParameterError:
    owner = engine.mode == "owner"
    built = "the dedication and this optimizer were" if owner else "this optimizer was"
    here = _on_this_rank(names)
    return ThawedParameterError(
        f"DMuon step {number}: parameter(s) that did not require a gradient when {built} "
        f"built hold one now, on rank(s) {ranks}{here}. Mode {engine.mode!r} planned its "
        "owners and buffers without them, so nothing would average their gradients across "
        f"ranks or step them alike. Unfreeze them before {'dedicate() and ' if owner else ''}"
        "DMuon(...) (to hold a layer still for a while, keep it trainable in a param group "
        "of its own with lr=0). Nothing was updated on any rank",
        ranks,
        names,
    )


def _written_error(written: Mapping[int, list[str]], number: int | None) -> RankDivergenceError:
    """Dedicated weights written while their publication was in flight (``written``: each
    rank's names, gathered), named on every rank."""
    by_name: dict[str, list[int]] = {}
    for rank in sorted(written):
        for name in written[rank]:
            by_name.setdefault(name, []).append(rank)
    shown = "; ".join(f"{name!r} on rank(s) {ranks}" for name, ranks in list(by_name.items())[:5])
    more = f" and {len(by_name) - 5} more" if len(by_name) > 5 else ""
    return RankDivergenceError(
        f"DMuon step {number} refused on every rank: dedicated weight(s) were written after "
        f"the last opt.step() while their new values were still arriving from their owners: "
        f"{shown}{more}. In owner mode each weight is broadcast from its owner after "
        "step(), so a write before that broadcast is waited for (a re-init, an EMA copy_to, "
        "p.mul_(...), p.data = ...) is overwritten on the ranks that do not "
        "own the weight and may be lost on its owner: the ranks now hold different weights. "
        "Call Dedication.wait() (ded.wait()) on every rank after opt.step() before writing "
        "or reading weights outside a forward. Nothing was updated by this step; redo the "
        "write after ded.wait() if it sets the weights the same way on every rank (a copy_ "
        "or a seeded re-init), else reload a checkpoint, then zero_grad() and go on",
        list(by_name),
        list(by_name.values()),
    )


def _changed_error(ranks: list[int], names: list[str], engine: Engine) -> GradientChangedError:
    here = _on_this_rank(names)
    return GradientChangedError(
        f"a gradient was changed after DMuon took it to reduce to its owner, on "
        f"rank(s) {ranks}{here}. In {engine.mode!r} mode each gradient leaves for its owner "
        "as backward produces it, so a change between backward and step() (torch.nn.utils."
        "clip_grad_norm_, p.grad.mul_(...), a new p.grad) would be lost. Nothing was "
        "updated on any rank, and this iteration's gradients are spent: zero_grad() and go on "
        "with the next backward. Clip with dmuon.optim.clip_grad_norm_(opt, max_norm) or "
        "dmuon.optim.clip_grad_value_(opt, clip_value), which clip the reduced gradients. "
        "A model wrapped in DistributedDataParallel after dedicate() does this too (DDP "
        "all-reduces the gradients in place after backward): dedicate() replaces DDP, so "
        "drop the wrapper. A post-accumulate-grad hook of your own registered after "
        "dedicate() (p.register_post_accumulate_grad_hook changing or replacing p.grad) "
        "does it on every step: register it before dedicate(), or make it a tensor hook "
        "(p.register_hook(lambda g: g * 0.5)), which changes the gradient before DMuon "
        "takes it",
        ranks,
        names,
    )


def _stale_error(ranks: list[int], names: list[str]) -> StaleGradientError:
    here = _on_this_rank(names)
    return StaleGradientError(
        f"a gradient was still the averaged gradient the last step left on its owner, "
        f"not zeroed since, on rank(s) {ranks}{here}: this step's backward added to it, or "
        "step() was called again without a backward. Owner mode reduces each matrix's "
        "gradient to its owner only, so the others hold none to add to and the sum would "
        "be wrong. Call opt.zero_grad() after each opt.step() (to accumulate micro-batches "
        "within a step, run all but the last inside no_sync(); a zeroing through "
        "p.grad.data is not seen: use opt.zero_grad() or model.zero_grad()). Nothing was "
        "updated on any rank, and this iteration's gradients are spent: zero_grad() and go "
        "on",
        ranks,
        names,
    )


# Devices whose first pass over the gradients is torch._foreach_norm's fused ℓ1 norms
# (one launch per dtype group) rather than a sum per gradient (see _nonfinite_names).
FUSED_DEVICES = ("cuda",)


# Gradients of at most this many entries are checked together on a CPU: flattened into
# chunks of at most SMALL_CHUNK entries, one sum per chunk (see _nonfinite_names).
SMALL_GRAD = 1 << 12
SMALL_CHUNK = 1 << 20


def _nonfinite_names(engine: Engine, vouched: frozenset[int] = frozenset()) -> list[str]:
    """This rank's parameters whose gradient holds NaN or Inf (but those of ``vouched``,
    whose local gradient the step's begin releases or the engine has proven finite, see
    :func:`agree_step`)."""
    entries = []
    for e in engine.params:
        if vouched and id(e.param) in vouched:
            continue
        g = e.param.grad
        if g is None:
            continue
        g = _local(g)
        if g.numel() > 0:  # a sparse gradient was refused before (GroupRecord.check)
            entries.append((e, g))
    if not entries:
        return []
    with torch.no_grad():
        grads = [g for _, g in entries]
        # A finite sum proves every entry finite (an Inf or NaN entry makes every partial
        # sum it enters, and so the sum, Inf or NaN), and a sum is one cheap read. Only a
        # gradient whose sum is not finite (a NaN/Inf entry, or finite entries whose sum
        # overflows) is decided by the exact max|g|: on one x86 core, torch 2.13, the
        # ∞-norms of the 112 gradients of the Llama-1B/4 benchmark took 263 ms a step, their
        # sums 24 ms. On a GPU a sum per gradient is a kernel launch per gradient: there the
        # ℓ1 norms (Σ|g|, finite for the same reason) come from torch._foreach_norm, a few
        # fused launches for all of them. On a CPU a sum costs a few µs of dispatch however
        # small the gradient: the small ones (biases, norms) are summed together, flattened
        # into chunks, and only a chunk whose sum is not finite is summed gradient by
        # gradient (the same answer, see _suspects).
        if grads[0].device.type in FUSED_DEVICES:
            firsts = torch._foreach_norm(grads, 1)
            suspects = _not_finite(firsts)
        else:
            suspects = _suspects(grads)
        if not suspects:
            return []
        worst = torch._foreach_norm([grads[i] for i in suspects], math.inf)
        ok = torch.isfinite(torch.stack([n.float() for n in worst])).tolist()
    return [entries[i][0].name for i, fine in zip(suspects, ok, strict=True) if not fine]


def _not_finite(sums: Sequence[torch.Tensor], index: Sequence[int] | None = None) -> list[int]:
    """The positions (or ``index``'s entries) of the sums that are not finite."""
    finite = torch.isfinite(torch.stack([t.float() for t in sums]))
    if bool(finite.all()):
        return []
    at = range(len(sums)) if index is None else index
    return [i for i, fine in zip(at, finite.tolist(), strict=True) if not fine]


def _suspects(grads: Sequence[torch.Tensor]) -> list[int]:
    """The positions of the gradients whose sum is not finite (on a CPU), in order.

    The CPU gradients of at most :data:`SMALL_GRAD` entries are summed together, flat, in
    chunks of at most :data:`SMALL_CHUNK` entries (one copy each); a chunk whose sum is
    finite proves each of its gradients finite, the gradients of any other chunk are summed
    one by one, as every other gradient is — so the answer is each gradient's own sum's.
    """
    alone: list[int] = []
    chunks: list[list[int]] = [[]]
    size = 0
    for i, g in enumerate(grads):
        n = g.numel()
        if n > SMALL_GRAD or not g.is_cpu:
            alone.append(i)
            continue
        if size + n > SMALL_CHUNK:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += n
    suspects = _not_finite([grads[i].sum() for i in alone], alone) if alone else []
    for part in chunks:
        if not part:
            continue
        if len(part) > 1:
            total = torch.cat([grads[i].flatten() for i in part]).sum()
        else:
            total = grads[part[0]].sum()
        if not bool(torch.isfinite(total)):
            suspects += _not_finite([grads[i].sum() for i in part], part)
    return sorted(suspects)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Integer sum of the bit patterns (exact; any changed element changes it, except
    for changes that cancel, which random divergence does not produce): an ``int64``
    scalar on ``t``'s device, not read back (one read for all of them, not one each)."""
    x = _local(t).detach().contiguous().reshape(-1)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[x.element_size()]
    ints = x.view(bits).to(torch.int64)
    # Weight by position so that two swapped elements do not cancel. An int64 sum that
    # overflows wraps (modulo 2⁶⁴), in any order alike: the ranks still agree.
    weights = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) % 8191 + 1
    return (ints * weights).sum()


def _checksums(params: Sequence[EngineParam], device: torch.device) -> torch.Tensor:
    """The :func:`_checksum` of each parameter, in order, on ``device``: stacked on each
    parameter device and moved once per device (a parameter on the GPU is not read
    back one by one: a synchronisation each)."""
    sums = [_checksum(e.param) for e in params]
    out = torch.empty(len(sums), dtype=torch.int64, device=device)
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    for at in by_device.values():
        out[torch.tensor(at, device=device)] = torch.stack([sums[i] for i in at]).to(device)
    return out


def check_agreement(engine: Engine) -> int:
    """Compare a checksum of every replicated parameter across ranks; raise if any differs.

    Returns:
        The number of parameters compared.

    Raises:
        RankDivergenceError: on every rank, naming the parameters and the ranks.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> opt = DMuon([torch.nn.Parameter(torch.ones(2, 2))])
        >>> check_agreement(opt.engine)
        1
    """
    engine.settle()
    # by name: the ranks may list the same parameters in different orders
    params: list[EngineParam] = sorted(engine.replicated_params(), key=lambda e: e.name)
    groups = engine.guard_groups()
    if not groups or not params:
        return len(params)
    sums = _checksums(params, flag_device(groups[0]))
    names: list[str] = []
    who: list[list[int]] = []
    for g in groups:
        n = dist.get_world_size(g)
        flat = torch.empty(n * sums.numel(), dtype=torch.int64, device=sums.device)
        wait_work(
            all_gather_single(flat, sums, group=g, async_op=True),
            "all-gather of parameter checksums",
            g,
        )
        gathered = flat.view(n, sums.numel())
        ranks = dist.get_process_group_ranks(g) if g is not None else list(range(n))
        differs = (gathered != gathered[0]).any(dim=0)
        for k in torch.nonzero(differs).flatten().tolist():
            if params[k].name not in names:
                names.append(params[k].name)
                who.append(
                    [ranks[0]] + [ranks[r] for r in range(n) if gathered[r, k] != gathered[0, k]]
                )
    if names:
        lines = [
            f"  {name!r}: rank(s) {ranks[1:]} hold another value than rank {ranks[0]}"
            for name, ranks in zip(names[:10], who[:10], strict=False)
        ]
        who = [ranks[1:] for ranks in who]
        raise RankDivergenceError(
            f"{len(names)} parameter(s) that every rank should hold identically differ "
            "between ranks (a rank stepped differently, or its weights were changed outside "
            "the optimizer):\n" + "\n".join(lines),
            names,
            who,
        )
    return len(params)
