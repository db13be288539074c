"""Bytes per rank per step, for each execution mode, by the formulas the wrappers record.

DMuon's own traffic is counted exactly as :class:`dmuon.comm.CommStats` counts it when
the engine runs: the same buffers (per layer, per dtype, per owner), the same padding,
and :meth:`~dmuon.comm.CommStats.record_collective` (hence
:func:`dmuon.comm.cost_model`) for the per-rank bytes of each collective. The
planner's figures therefore equal what a run records; the tests check it on real
gloo ranks. The training framework's own traffic (FSDP2's all-gathers and
reduce-scatters, DDP's all-reduce), which DMuon does not record, follows the ring
formulas of :func:`~dmuon.comm.cost_model`.

=============== ============================================================ ========
mode            DMuon's collectives per step                                 phase
=============== ============================================================ ========
owner           ``reduce`` of every matrix to its owner, per unit bucket     backward
                ``broadcast`` of every matrix from its owner                 forward
owner-z3        as owner, and a second ``broadcast`` before backward         both
owner-ddp       as owner, and an ``all_reduce`` of the scalars per unit      both
                and dtype (``all_reduce_replicated``)
owner-ddp-zero1 as owner, over a plan of the matrices and the scalars:       both
                every scalar ``reduce``-d to its owner and broadcast back
                in its unit's buckets (ZeRO-1-like: AdamW state on owners)
replicated      one ``all_gather`` of the updates per unit and dtype,        step
                every rank's chunk padded to the largest owner volume
sharded         one ``all_to_all`` of row shards (padded to ⌈rows/N⌉) to     step
                the owners per unit and dtype, and one back
sign            one packed majority vote (``all_to_all`` + ``all_gather`` of step
                ⌈numel/5N⌉ bytes) per batched rule call; an ``all_reduce``
                of the scalar gradients
=============== ============================================================ ========

Every mode's unit is a layer, or a pack of consecutive small layers, cut by the
engine's own rule (:func:`~dmuon.optim.engine.layer_packing.pack_runs`, which
:func:`~dmuon.optim.engine.layer_record.pack_layers` applies) over the same bytes:
one bucket per owner and dtype of a unit, one round of latency per unit. The planned
modes (``replicated``, ``sharded``, ``sign``) pack by the same rule over their whole
matrices' bytes (``PlannedEngine``, DMuon's ``layer_pack_mb``). ``owner``
and ``owner-z3`` are ``fsdp.dedicate``'s, whose scalars are FSDP2's: a unit's bytes
are its matrices'. ``owner-ddp`` is ``ddp.dedicate``'s (``scalars="all_reduce"``): the
exchange also all-reduces the scalar parameters, each under its name's layer, one
flat bucket per unit and dtype (``engine/reduction.py``, recorded as
``all_reduce_replicated``), and their bytes count in its packs
(``_owner_units(all_reduced=...)``). ``owner-ddp-zero1`` is
``ddp.dedicate(scalars="owner")``'s: the scalars are dedicated too
(``selection.split_parameters(dedicate_rest=True)``: each whole, as a ``(1, numel)``
item, under its name's layer), planned with the matrices by
:func:`dmuon.comm.plan_owners` (:func:`owned_scalar_items`), and the exchange treats them
as any dedicated item: a unit's buckets per owner and dtype hold its matrices and its
scalars, reduced to the owners (who step them with AdamW) and broadcast back; nothing
is all-reduced, and the plan the planner is given must hold the scalars by name.
``owner-z3`` and a tensor-parallel model
(``tp > 1``) keep one layer a unit, as the exchange does. :func:`step_units` gives
each mode's units, which also cut its rule calls
(:mod:`~dmuon.optim.planner.rule_calls`).

Every mode but ``replicated`` also all-reduces the gradient-presence flags of the
parameters it steps (``presence_flags``) at the start of the step, with the step's
agreement (a slot per rank, and four for the group values) in the same ``int64``
all-reduce: owner mode for the dedicated items (``owner-ddp``: and the all-reduced
scalars; ``owner-ddp-zero1``: the owned scalars are dedicated items), ``sharded`` and
``sign`` for all their parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dmuon.comm import VOTES_PER_BYTE, CommStats, MatrixItem, OwnerPlan, layer_key
from dmuon.comm.cost_model import cost_model
from dmuon.comm.owner_plan import natural_key
from dmuon.optim.batch_cuts import batch_runs
from dmuon.optim.engine.guards import VALUE_SLOTS
from dmuon.optim.engine.layer_packing import DEFAULT_PACK_MB, check_pack_mb, pack_runs
from dmuon.optim.engine.params import subplan
from dmuon.optim.planner.config import ModelSpec

__all__ = [
    "DMUON_MODES",
    "OWNER_MODES",
    "Transfer",
    "all_reduced_scalars",
    "dmuon_transfers",
    "framework_transfers",
    "fsdp_copied_bytes",
    "owned_scalar_items",
    "per_rank_ops",
    "ring_transfer",
    "step_units",
]

DMUON_MODES = (
    "owner",
    "owner-z3",
    "owner-ddp",
    "owner-ddp-zero1",
    "replicated",
    "sharded",
    "sign",
)
"""The DMuon execution modes the planner predicts (``owner`` and ``owner-z3``:
``fsdp.dedicate``'s owner mode, ``owner-z3`` with ``reshard_after_forward=True``;
``owner-ddp``: ``ddp.dedicate``'s, whose exchange also all-reduces the scalars;
``owner-ddp-zero1``: ``ddp.dedicate(scalars="owner")``'s, whose scalars have owners
too)."""

OWNER_MODES = ("owner", "owner-z3", "owner-ddp", "owner-ddp-zero1")
"""The modes of a dedication (owner mode's exchange)."""


@dataclass
class Transfer:
    """One kind of collective in a step: what each rank sends and receives.

    Attributes:
        op: the :class:`~dmuon.comm.CommStats` name (``"reduce_to_owners"`` …) or a
            framework name (``"fsdp_all_gather"`` …).
        collective: the torch.distributed collective (for the latency steps).
        phase: ``"forward"``, ``"backward"`` or ``"step"``: what it can overlap with.
        sent: bytes sent per rank.
        received: bytes received per rank.
        collectives: collectives issued per rank.
        rounds: how many times the latency is paid in sequence: the collectives of one
            layer are issued together, asynchronously, and their start-up latencies
            overlap, so a per-layer transfer pays it once per layer; a synchronous one
            (Sign-Muon's votes) once per collective.
        group_size: ranks in each collective.
        recorded: whether DMuon's ``CommStats`` records it.
        stride: rank distance between the members of a group (``T`` for a data-parallel
            group of a ``dp × tp`` mesh): the group spans ``group_size · stride``
            consecutive ranks, which decides its link.
        inside_ns: a tensor-parallel collective inside Newton–Schulz; its time is the
            prediction's ``tp_s``, not a phase's.
        copied: bytes each rank's memory moves around the collective (read + write of
            the copies into and out of its buffers), charged at the device's
            element-wise rate: FSDP2's copy-in and copy-out (0 where not modelled).
    """

    op: str
    collective: str
    phase: str
    sent: list[float]
    received: list[float]
    collectives: int = 0
    group_size: int = 1
    recorded: bool = True
    rounds: int = 0
    notes: list[str] = field(default_factory=list)
    stride: int = 1
    inside_ns: bool = False
    copied: float = 0.0

    @property
    def max_bytes(self) -> float:
        """The busiest rank's ``max(sent, received)``: what the α–β time is charged on."""
        return max(max(s, r) for s, r in zip(self.sent, self.received, strict=True))


def _unit_of(plan: OwnerPlan, max_bytes: int) -> dict[str, int]:
    """Each layer key's step unit (its index in :func:`_owner_units`)."""
    return {k: i for i, run in enumerate(_owner_units(plan, max_bytes)) for k in run}


def _layer(item: MatrixItem) -> str:
    return item.layer if item.layer is not None else item.name


def _units(plan: OwnerPlan, max_bytes: int) -> list[OwnerPlan]:
    """The plan of each step unit of a planned mode (``replicated``, ``sharded``): its
    layers packed by the engine's rule over the whole matrices' bytes, as
    ``PlannedEngine`` cuts them (``engine/planned.py``); ``0``: a layer a unit."""
    unit_of = _unit_of(plan, max_bytes)
    names: dict[int, list[str]] = {}
    for item in plan.items:
        names.setdefault(unit_of[_layer(item)], []).append(item.name)
    return [subplan(plan, names[i]) for i in sorted(names)]


def _collective(op: str, collective: str, phase: str, n: int) -> Transfer:
    return Transfer(op, collective, phase, [0.0] * n, [0.0] * n, group_size=n)


def _record(t: Transfer, collective: str, nbytes: int | Sequence[int], n: int) -> None:
    """Add collectives of ``nbytes`` each (one per entry of a sequence) as
    CommStats.record_collective counts them; every rank sends and receives the same."""
    sizes = [nbytes] if isinstance(nbytes, int) else list(nbytes)
    if not sizes:
        return
    stats = CommStats()
    for size in sizes:
        stats.record_collective(t.op, collective, nbytes=size, world_size=n)
    s = stats[t.op]
    # one pass over the ranks for all of them (O(n), not O(n) per collective)
    t.sent = [x + s.bytes_sent for x in t.sent]
    t.received = [x + s.bytes_received for x in t.received]
    t.collectives += len(sizes)


def _presence(count: int, n: int, phase: str, itemsize: int = 4) -> Transfer:
    t = _collective("presence_flags", "all_reduce", phase, n)
    _record(t, "all_reduce", itemsize * count, n)
    t.rounds = 1
    return t


def _owner_units(
    plan: OwnerPlan, max_bytes: int, all_reduced: Sequence[tuple[str, str, int]] = ()
) -> list[list[str]]:
    """The layer keys of each unit of the owner-mode step, as the exchange cuts them.

    The layers (an item's ``layer``, else its name; the layer of each all-reduced
    parameter) in natural order, packed by the engine's rule
    (:func:`~dmuon.optim.engine.layer_packing.pack_runs`, which
    :func:`~dmuon.optim.engine.layer_record.pack_layers` applies to its records) over
    the bytes each layer's unit carries: its matrices, and its ``all_reduced``
    parameters where the exchange all-reduces them (``ddp.dedicate``'s scalars;
    ``fsdp.dedicate`` leaves the scalars to FSDP2, and its units hold matrices only).
    One device (the planner's ranks each have one). ``0``: a layer a unit.

    Args:
        plan: the owner plan (its items' ``nbytes``: each rank's local part).
        max_bytes: the pack limit (``layer_pack_mb`` in bytes).
        all_reduced: ``(name, layer key, nbytes)`` of the parameters the exchange
            all-reduces.
    """
    by_layer: dict[str, int] = {}
    for item in plan.items:
        key = item.layer if item.layer is not None else item.name
        by_layer[key] = by_layer.get(key, 0) + item.nbytes
    for _, key, nbytes in all_reduced:
        by_layer[key] = by_layer.get(key, 0) + nbytes
    layers = [(k, by_layer[k], None) for k in sorted(by_layer, key=natural_key)]
    return pack_runs(layers, max_bytes)


def all_reduced_scalars(spec: ModelSpec) -> list[tuple[str, str, int]]:
    """``(name, layer key, nbytes)`` of the scalar parameters ``ddp.dedicate`` all-reduces
    in its exchange (``scalars="all_reduce"``): each under its name's layer
    (:func:`dmuon.comm.layer_key`, the dedication's default ``layer_of``), in the
    matrices' dtype (the planner's one dtype of parameters and traffic)."""
    e = spec.matrices[0].dtype.itemsize if spec.matrices else 4
    return [(name, layer_key(name), numel * e) for name, numel in spec.scalars]


def owned_scalar_items(spec: ModelSpec) -> list[MatrixItem]:
    """The scalar parameters as ``ddp.dedicate(scalars="owner")`` plans them with the
    matrices (``selection.split_parameters(dedicate_rest=True)``): each whole, as a
    ``(1, numel)`` item (costed as one row: its owner's element-wise work, not the
    Newton–Schulz of its shape), under its name's layer (:func:`dmuon.comm.layer_key`),
    in the matrices' dtype (the planner's one dtype).
    ``plan_owners([*spec.matrices, *owned_scalar_items(spec)], N)`` is that mode's plan.

    Examples:
        >>> from dmuon.optim.planner.config import load_model
        >>> items = owned_scalar_items(load_model("gpt2"))
        >>> len(items), items[0].name, items[0].shape  # the token embedding: one row
        (100, 'transformer.wte.weight', (1, 38597376))
        >>> items[2].name, items[2].shape, items[2].layer  # a bias: one row, its layer
        ('transformer.h.0.attn.c_attn.bias', (1, 2304), 'transformer.h.0')
    """
    dtype = spec.matrices[0].dtype if spec.matrices else torch.float32
    return [MatrixItem(name, (1, numel), dtype, layer_key(name)) for name, numel in spec.scalars]


def _check_owned_scalars(spec: ModelSpec, plan: OwnerPlan) -> None:
    """Refuse an ``owner-ddp-zero1`` plan that does not hold every scalar by name."""
    missing = [name for name, _ in spec.scalars if name not in plan.names]
    if missing:
        raise ValueError(
            f"mode 'owner-ddp-zero1' (ddp.dedicate(scalars='owner')) needs the plan of the "
            f"matrices and the scalars (plan_owners([*spec.matrices, "
            f"*owned_scalar_items(spec)], N)); this plan lacks {len(missing)} scalar(s), "
            f"e.g. {missing[0]!r}"
        )


def step_units(
    spec: ModelSpec, plan: OwnerPlan, mode: str, *, layer_pack_mb: float = DEFAULT_PACK_MB
) -> list[list[str]]:
    """The layer keys of each step unit of ``mode`` (the engine's pipeline groups), in
    step order: owner mode's units, packed by :func:`_owner_units` over the bytes the
    exchange carries (``owner-ddp``: the all-reduced scalars too; ``owner-ddp-zero1``: the
    plan's owned scalars; ``owner-z3``: nothing packed), and the planned modes' units
    (``replicated``, ``sharded``, ``sign``: ``PlannedEngine`` packs the layers by the same
    rule over the whole matrices' bytes; ``sign`` steps every matrix on every rank, unit
    by unit, its vote per batched call).

    Args:
        spec: the model (its scalars' names, for ``owner-ddp``).
        plan: the owner plan (its items' ``nbytes``: each rank's local part;
            ``owner-ddp-zero1``: the plan of the matrices and the scalars).
        mode: one of :data:`DMUON_MODES`.
        layer_pack_mb: the pack limit: owner mode's (the exchange's
            ``layer_pack_mb``), the planned modes' (DMuon's); ``0``: nothing packed (a
            tensor-parallel model).
    """
    if mode not in DMUON_MODES:
        raise ValueError(f"mode must be one of {DMUON_MODES}, got {mode!r}")
    max_bytes = check_pack_mb(layer_pack_mb)
    if mode == "owner-ddp-zero1":  # the scalars are the plan's items
        _check_owned_scalars(spec, plan)
        return _owner_units(plan, max_bytes)
    if mode in ("owner", "owner-ddp"):
        scalars = all_reduced_scalars(spec) if mode == "owner-ddp" else ()
        return _owner_units(plan, max_bytes, all_reduced=scalars)
    if mode == "owner-z3":  # a layer is freed after its own forward: never packed
        return _owner_units(plan, 0)
    return _owner_units(plan, max_bytes)  # the planned modes: whole matrices' bytes


def _owner(
    plan: OwnerPlan,
    n: int,
    z3: bool,
    max_bytes: int,
    all_reduced: Sequence[tuple[str, str, int]] = (),
) -> list[Transfer]:
    reduce = _collective("reduce_to_owners", "reduce", "backward", n)
    bcast = _collective("broadcast_from_owners", "broadcast", "forward", n)
    again = _collective("broadcast_from_owners", "broadcast", "backward", n)
    units = _owner_units(plan, 0 if z3 else max_bytes, all_reduced)
    items_of: dict[str, list[MatrixItem]] = {}
    for item in plan.items:
        items_of.setdefault(item.layer if item.layer is not None else item.name, []).append(item)
    scalars_of: dict[str, int] = {}
    for _, key, nbytes in all_reduced:
        scalars_of[key] = scalars_of.get(key, 0) + nbytes
    sizes: list[int] = []
    summed: list[int] = []
    for unit in units:
        # one bucket per (owner, dtype) of the unit: make_buckets, alignment 1
        buckets: dict[tuple[int, torch.dtype], int] = {}
        for item in (i for key in unit for i in items_of.get(key, ())):
            slot = (plan.owner(item.name), item.dtype)
            buckets[slot] = buckets.get(slot, 0) + item.nbytes
        sizes.extend(buckets.values())
        # ddp.dedicate: one all-reduce bucket per dtype of the unit's scalars (one dtype)
        nbytes = sum(scalars_of.get(key, 0) for key in unit)
        if nbytes:
            summed.append(nbytes)
    for t in (reduce, bcast, again):
        t.rounds = sum(1 for unit in units if any(key in items_of for key in unit))
    _record(reduce, "reduce", sizes, n)
    _record(bcast, "broadcast", sizes, n)
    _record(again, "broadcast", sizes, n)
    # ZeRO-3-like: each layer is broadcast again before its backward
    # presence flags: one per dedicated item (and all-reduced scalar), two slots for the
    # engine's UnsyncedGradientsError check (the gradients held back by no_sync(), the
    # ranks that synchronised one), and the step's agreement carried in the same
    # all-reduce (one slot per rank and VALUE_SLOTS for the group values: engine/guards.py's
    # agree_step), all int64, at the step's start
    agreement = n + VALUE_SLOTS
    presence = _presence(len(plan.items) + len(all_reduced) + 2 + agreement, n, "step", 8)
    out = [reduce, bcast, *([again] if z3 else []), presence]
    if summed:
        # issued with the unit's reductions from the backward hooks (one round a unit)
        scalars = _collective("all_reduce_replicated", "all_reduce", "backward", n)
        _record(scalars, "all_reduce", summed, n)
        scalars.rounds = len(summed)
        out.insert(1, scalars)
    return out


def _replicated(plan: OwnerPlan, n: int, max_bytes: int) -> list[Transfer]:
    t = _collective("all_gather_updates", "all_gather", "step", n)
    units = _units(plan, max_bytes)
    t.rounds = len(units)
    sizes: list[int] = []
    for part in units:
        for dtype, by_owner in _volumes(part, lambda i: i.numel).items():
            # the all-gather moves the largest owner's share from every rank
            sizes.append(max(by_owner.values()) * dtype.itemsize)
    _record(t, "all_gather", [s for s in sizes if s], n)
    return [t]


def _volumes(
    part: OwnerPlan, size: Callable[[MatrixItem], int]
) -> dict[torch.dtype, dict[int, int]]:
    """Per dtype (in the order of the items), ``size`` summed per owning rank (ranks
    that own nothing of a dtype are left out: their volume is 0)."""
    out: dict[torch.dtype, dict[int, int]] = {}
    for item in part.items:
        by_owner = out.setdefault(item.dtype, {})
        owner = part.owner(item.name)
        by_owner[owner] = by_owner.get(owner, 0) + size(item)
    return out


def _sharded(plan: OwnerPlan, n: int, params: int, max_bytes: int) -> list[Transfer]:
    there = _collective("shard_all_to_all", "all_to_all", "step", n)
    back = _collective("shard_all_to_all_reverse", "all_to_all", "step", n)
    units = _units(plan, max_bytes)
    there.rounds = back.rounds = len(units)
    for part in units:
        shard = lambda i: -(-i.shape[0] // n) * math.prod(i.shape[1:])  # noqa: E731
        for dtype, by_owner in _volumes(part, shard).items():
            total = sum(by_owner.values())
            if not total:
                continue
            e = dtype.itemsize
            # rank `me` sends its shard of every other owner's matrices and receives the
            # shards of its own from the n − 1 others; the reverse all-to-all mirrors it
            for me in range(n):
                mine = by_owner.get(me, 0)
                there.sent[me] += (total - mine) * e
                there.received[me] += (n - 1) * mine * e
                back.sent[me] += (n - 1) * mine * e
                back.received[me] += (total - mine) * e
            there.collectives += 1
            back.collectives += 1
    # the presence flags ride in the step's agreement (a slot per rank, VALUE_SLOTS for
    # the group values), all int64 (engine/planned.py's begin_step_agreeing)
    return [there, back, _presence(params + n + VALUE_SLOTS, n, "step", 8)]


def _chunks(counts: Sequence[int], per: int, limit: int) -> list[int]:
    """Matrices per batched call: consecutive runs of entries (``counts`` matrices each)
    holding at most ``limit`` matrix entries, at least one entry each
    (:func:`dmuon.optim.batch_cuts.batch_runs`, as the engine batches)."""
    runs = batch_runs([c * per for c in counts], limit)
    return [sum(counts[i] for i in run) for run in runs]


def _sign(
    spec: ModelSpec, plan: OwnerPlan, n: int, batch_limit: int, max_bytes: int
) -> list[Transfer]:
    vote = _collective("majority_vote[packed]", "all_to_all", "step", n)
    # a vote per batched call of a step unit (a layer, or a pack of small ones) and shape
    unit_of = _unit_of(plan, max_bytes)
    by_unit_shape: dict[tuple[int, tuple[int, int], torch.dtype], list[int]] = {}
    for item in spec.matrices:
        key = (unit_of.get(_layer(item), -1), (item.rows, item.cols), item.dtype)
        by_unit_shape.setdefault(key, []).append(item.batch)
    for (_, (m, k), _), counts in by_unit_shape.items():
        for b in _chunks(counts, m * k, batch_limit):
            numel = b * m * k
            chunk = -(-numel // (VOTES_PER_BYTE * n))  # five votes per byte
            for r in range(n):  # all-to-all of the packed signs, all-gather of the majority
                vote.sent[r] += 2 * (n - 1) * chunk
                vote.received[r] += 2 * (n - 1) * chunk
            vote.collectives += 2
            vote.rounds += 2  # synchronous: the vote sits between the two transfers
    scalars = _collective("all_reduce_scalars", "all_reduce", "step", n)
    nbytes = spec.scalar_params * spec.matrices[0].dtype.itemsize if spec.matrices else 0
    if nbytes:
        _record(scalars, "all_reduce", nbytes, n)
        scalars.rounds = 1
    # the presence flags ride in the step's agreement, as in sharded mode (_sharded)
    flags = len(spec.matrices) + len(spec.scalars) + n + VALUE_SLOTS
    return [vote, scalars, _presence(flags, n, "step", 8)]


def dmuon_transfers(
    spec: ModelSpec,
    plan: OwnerPlan,
    mode: str,
    *,
    batch_limit: int = 1 << 62,
    layer_pack_mb: float = DEFAULT_PACK_MB,
) -> list[Transfer]:
    """DMuon's collectives of one step in ``mode``, as ``CommStats`` would record them.

    Args:
        spec: the model.
        plan: the owner plan of ``spec.matrices`` over the data-parallel ranks (the
            plan the engine makes: :func:`dmuon.comm.plan_owners` with its options);
            ``owner-ddp-zero1``: of the matrices and :func:`owned_scalar_items`.
        mode: one of :data:`DMUON_MODES`.
        batch_limit: matrix entries per batched rule call (sign mode's votes):
            :func:`dmuon.optim.batch_cuts.default_batch_elements` of the device.
        layer_pack_mb: the pack limit of the step units: owner mode's (the exchange's
            ``layer_pack_mb``), the planned modes' (DMuon's ``layer_pack_mb``); ``0``
            where nothing is packed (``owner-z3`` never packs; nor does a
            tensor-parallel model: :func:`~dmuon.optim.planner.step_model.predict`
            passes ``0`` for ``tp > 1``).

    Examples:
        >>> from dmuon.comm import plan_owners
        >>> from dmuon.optim.planner.config import load_model
        >>> spec = load_model("gpt2")
        >>> plan = plan_owners(spec.matrices, 8)
        >>> ts = dmuon_transfers(spec, plan, "owner")
        >>> P = sum(i.nbytes for i in spec.matrices)  # reduce + broadcast = one ring all-reduce
        >>> round((ts[0].sent[0] + ts[1].sent[0]) / (2 * 7 / 8 * P), 9)
        1.0
    """
    n = plan.world_size
    if mode not in DMUON_MODES:
        raise ValueError(f"mode must be one of {DMUON_MODES}, got {mode!r}")
    if mode == "owner-ddp-zero1":
        _check_owned_scalars(spec, plan)
    if n == 1:
        return []
    if mode == "owner-ddp-zero1":  # the scalars are dedicated items: owner mode's buckets
        return _owner(plan, n, z3=False, max_bytes=check_pack_mb(layer_pack_mb))
    if mode in ("owner", "owner-z3", "owner-ddp"):
        scalars = all_reduced_scalars(spec) if mode == "owner-ddp" else ()
        max_bytes = check_pack_mb(layer_pack_mb)
        return _owner(plan, n, z3=mode == "owner-z3", max_bytes=max_bytes, all_reduced=scalars)
    max_bytes = check_pack_mb(layer_pack_mb)
    if mode == "replicated":
        return _replicated(plan, n, max_bytes)
    if mode == "sharded":
        return _sharded(plan, n, len(spec.matrices) + len(spec.scalars), max_bytes)
    return _sign(spec, plan, n, batch_limit, max_bytes)


def ring_transfer(
    op: str, collective: str, phase: str, nbytes: float, n: int, rounds: int = 1
) -> Transfer:
    """A framework collective of ``nbytes`` over ``n`` ranks, priced by the ring formulas
    of :func:`~dmuon.comm.cost_model` (not recorded by ``CommStats``)."""
    t = Transfer(op, collective, phase, [0.0] * n, [0.0] * n, group_size=n, recorded=False)
    c = cost_model(collective, int(nbytes), n)
    t.sent = [c.bytes_sent] * n
    t.received = [c.bytes_received] * n
    t.collectives = t.rounds = max(1, rounds)
    return t


def fsdp_copied_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank's memory moves around one FSDP2 collective of ``nbytes`` unsharded.

    FSDP2 copies around each collective: an all-gather copies the rank's shard into the
    flat send buffer (copy-in, ``nbytes/n`` read and written) and the gathered buffer out
    into the unsharded parameters (copy-out, ``nbytes`` read and written); a
    reduce-scatter copies the unsharded gradients into its flat buffer (``nbytes``) and
    the reduced shard out (``nbytes/n``). Either way ``2·nbytes·(1 + 1/n)``. (torch's
    ``torch.distributed.fsdp`` ``_fsdp_collectives``: ``foreach_all_gather`` /
    ``foreach_all_gather_copy_out`` / ``foreach_reduce``.) DDP's bucket copies are not
    charged: they happen as each gradient is produced, inside backward.
    """
    return 2 * nbytes * (1 + 1 / n)


DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb=25``: one all-reduce per bucket."""


def framework_transfers(spec: ModelSpec, mode: str, n: int) -> list[Transfer]:
    """The training framework's traffic in ``mode`` (ring formulas; not in ``CommStats``).

    ``adamw``: FSDP2 (ZeRO-3: all-gather before forward and before backward,
    reduce-scatter of the gradients) over every parameter. ``vanilla``: the same, plus
    an all-gather of every matrix gradient so that every rank can run Newton–Schulz
    on whole matrices (naive FSDP2 + Muon). ``owner``/``owner-z3``: FSDP2 over the
    scalar parameters only (the matrices are ``ignored_params``). ``sharded``: FSDP2
    over every parameter. ``replicated``: DDP's all-reduce of every gradient.
    ``owner-ddp``: nothing (``ddp.dedicate`` replaces DDP and all-reduces the scalars
    in its own exchange, recorded by ``CommStats``); ``owner-ddp-zero1``: nothing (its
    exchange reduces and broadcasts the scalars with the matrices).
    ``adamw-ddp``, ``vanilla-ddp``: DDP's all-reduce. ``sign``: nothing (DMuon
    all-reduces the scalars itself).
    """
    if n == 1:
        return []
    b = spec.matrices[0].dtype.itemsize if spec.matrices else 4
    everything = spec.total_params * b
    scalars = spec.scalar_params * b
    matrices = spec.matrix_params * b

    layers = max(1, len(spec.layers))  # fully_shard per block: one collective per block

    def fsdp(nbytes: float) -> list[Transfer]:
        out = [
            ring_transfer("fsdp_all_gather", "all_gather", "forward", nbytes, n, layers),
            ring_transfer("fsdp_all_gather_backward", "all_gather", "backward", nbytes, n, layers),
            ring_transfer("fsdp_reduce_scatter", "reduce_scatter", "backward", nbytes, n, layers),
        ]
        for t in out:
            t.copied = fsdp_copied_bytes(nbytes, n)
        return out

    ddp_rounds = -(-int(everything) // DDP_BUCKET_BYTES)

    if mode == "adamw" or mode == "sharded":
        return fsdp(everything)
    if mode == "vanilla":
        gather = ring_transfer("gather_gradients", "all_gather", "step", matrices, n, layers)
        return [*fsdp(everything), gather]
    if mode in ("owner", "owner-z3"):
        return fsdp(scalars)
    if mode in ("owner-ddp", "owner-ddp-zero1"):  # ddp.dedicate replaces DDP
        return []
    if mode in ("replicated", "adamw-ddp", "vanilla-ddp"):
        return [
            ring_transfer("ddp_all_reduce", "all_reduce", "backward", everything, n, ddp_rounds)
        ]
    if mode == "sign":
        return []
    raise ValueError(f"mode must be adamw, vanilla or one of {DMUON_MODES}, got {mode!r}")


def per_rank_ops(transfers: Sequence[Transfer], rank: int) -> dict[str, tuple[float, float]]:
    """``{op: (sent, received)}`` of ``rank`` for the recorded transfers (as CommStats)."""
    out: dict[str, tuple[float, float]] = {}
    for t in transfers:
        if t.recorded:
            s, r = out.get(t.op, (0.0, 0.0))
            out[t.op] = (s + t.sent[rank], r + t.received[rank])
    return out
