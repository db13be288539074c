"""The batched rule calls of a rank's step, cut as the engine cuts them, and their time.

A mode that steps its matrices layer by layer (``owner``, ``owner-z3``, ``owner-ddp``,
``owner-ddp-zero1``, ``replicated``, ``sharded``, and ``sign``, on every matrix) runs
the rule once per *step unit* and batch: the engine's pipeline groups
(:meth:`~dmuon.optim.engine.base.Engine.step_groups`) are owner mode's units (a layer,
or a pack of consecutive small layers,
:func:`~dmuon.optim.engine.layer_packing.pack_runs`) and the planned modes' layers;
within a unit, :func:`dmuon.optim.batch_layout.build_buckets` puts the matrices a rank steps
into one bucket per shape and dtype (a tensor-parallel matrix per whole shape and split,
``MatrixSplit.key``), in order of first appearance, and
:func:`dmuon.optim.batches.step_bucket` cuts each bucket into consecutive runs of at
most ``max_batch_elements`` matrix entries (:func:`dmuon.optim.batch_cuts.default_batch_elements`:
no cap on a GPU, ``2²⁰`` on a CPU). Same-shape matrices of different units never share
a call. So a rank's Newton–Schulz time is

    ``t_ns(r) = Σ_units Σ_calls [c₀ + Σ_matrices t(m, n)]``

with ``t(m, n)`` :meth:`dmuon.comm.NSCost.matrix_seconds` for a whole matrix; a call of
split matrices is priced whole, as the engine runs it
(:class:`~dmuon.optim.planner.parallel.SplitPricer`: the path the engine takes for the
call's batch, its compute, and its tp collectives once for the batch).
:func:`dmuon.comm.plan_owners`' loads batch a rank's same-shape matrices across every
layer instead: fewer calls than the engine makes (the planner balances owners with them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dmuon.comm import MatrixItem, NSCost
from dmuon.kernels import ns_flops
from dmuon.optim.batch_cuts import batch_runs
from dmuon.optim.planner.parallel import SplitChoice, SplitPricer

__all__ = ["HELD_UNIT", "layer_of", "rule_calls", "unit_flops", "unit_work"]

HELD_UNIT = "<held experts>"
"""The unit of the experts a rank holds outside the owner plan (``ep > 1``): stepped
where they live, as one group after the layers (sharded mode's ``LOCAL_EXPERTS``)."""


def layer_of(item: MatrixItem) -> str:
    """An item's layer key as the exchange and the planned engines key it: its
    ``layer``, else its name."""
    return item.layer if item.layer is not None else item.name


def rule_calls(
    items: Sequence[MatrixItem],
    units: Sequence[Sequence[str]],
    *,
    batch_limit: int,
    splits: Mapping[str, int] | None = None,
    held: Sequence[MatrixItem] = (),
) -> list[list[MatrixItem]]:
    """The rule calls of a rank that steps ``items`` (and ``held``), in step order.

    Args:
        items: the matrices the rank steps (each by its whole shape), in model order.
        units: the layer keys of each step unit, in step order; every item's layer key
            (:func:`layer_of`) must be in one.
        batch_limit: matrix entries per call (``max_batch_elements``); a matrix counts
            its whole ``rows × cols`` (a split one too: ``Bucket.elements``), an item of
            ``batch`` matrices ``batch`` times, and a call holds at least one item.
        splits: name → split dimension of the tensor-parallel matrices: batched only
            with matrices of the same whole shape and split.
        held: the rank's experts outside the plan: one unit of their own, last
            (:data:`HELD_UNIT`).

    Returns:
        The items of each call.

    Raises:
        ValueError: an item whose layer is in no unit.

    Examples:
        >>> from dmuon.comm import MatrixItem
        >>> items = [MatrixItem(f"h.{i}.{w}", (8, 8), layer=f"h.{i}") for i in (0, 1) for w in "ab"]
        >>> [len(c) for c in rule_calls(items, [["h.0", "h.1"]], batch_limit=1 << 62)]  # one pack
        [4]
        >>> [len(c) for c in rule_calls(items, [["h.0"], ["h.1"]], batch_limit=1 << 62)]
        [2, 2]
        >>> [len(c) for c in rule_calls(items, [["h.0"], ["h.1"]], batch_limit=64)]  # one per call
        [1, 1, 1, 1]
    """
    splits = splits or {}
    unit_of = {key: u for u, keys in enumerate(units) for key in keys}
    by_unit: list[list[MatrixItem]] = [[] for _ in units]
    for item in items:
        u = unit_of.get(layer_of(item))
        if u is None:
            raise ValueError(f"item {item.name!r}: its layer {layer_of(item)!r} is in no unit")
        by_unit[u].append(item)
    if held:
        by_unit.append(list(held))
    calls: list[list[MatrixItem]] = []
    for unit in by_unit:
        buckets: dict[tuple[object, ...], list[MatrixItem]] = {}
        for item in unit:
            dim = splits.get(item.name)
            key = (item.rows, item.cols, str(item.dtype), dim)
            buckets.setdefault(key, []).append(item)
        for bucket in buckets.values():
            calls.extend(_chunks(bucket, batch_limit))
    return calls


def _chunks(bucket: list[MatrixItem], limit: int) -> list[list[MatrixItem]]:
    """Consecutive runs of ``bucket`` of at most ``limit`` matrix entries, at least one
    item each (:func:`dmuon.optim.batch_cuts.batch_runs`, as the engine batches)."""
    sizes = [item.batch * item.rows * item.cols for item in bucket]
    return [[bucket[i] for i in run] for run in batch_runs(sizes, limit)]


def unit_work(
    calls: Sequence[Sequence[MatrixItem]],
    cost: NSCost,
    choices: Mapping[str, SplitChoice] | None = None,
    *,
    pricer: SplitPricer | None = None,
) -> tuple[float, float]:
    """(Newton–Schulz seconds, tensor-parallel collective seconds) of ``calls``.

    Each call pays :attr:`NSCost.call_overhead <dmuon.comm.NSCost>` once, and each of
    its matrices :meth:`NSCost.matrix_seconds <dmuon.comm.NSCost.matrix_seconds>`. A
    call of split matrices, with ``pricer``, is priced as the engine runs it
    (:class:`~dmuon.optim.planner.parallel.SplitPricer`: the path the engine takes for
    the call's batch, its compute, and its collectives once for the batch — the Gram
    matrices and the normalisation's scalars all-reduced together, or the shards
    all-gathered together). Without ``pricer``, each split matrix by its ``choices``
    entry (a matrix alone: its path's compute, ``SplitChoice.seconds − comm_seconds``),
    the call's tp collectives carrying every matrix's bytes and paying their latency once
    (``SplitChoice.latency``).

    Examples:
        >>> from dmuon.comm import MatrixItem, NSCost
        >>> cost = NSCost(call_overhead=50e-6)
        >>> w = MatrixItem("w", (256, 256))
        >>> one, _ = unit_work([[w, w]], cost)
        >>> two, _ = unit_work([[w], [w]], cost)
        >>> round((two - one) * 1e6)  # a second call: one more overhead
        50
    """
    choices = choices or {}
    seconds = tp = 0.0
    for call in calls:
        if not call:
            continue
        seconds += cost.call_overhead
        if pricer is not None and any(i.name in pricer.lay.splits for i in call):
            priced = pricer(call)
            seconds += priced.seconds - priced.comm_seconds
            tp += priced.comm_seconds
            continue
        split = [choices[i.name] for i in call if i.name in choices]
        for item in call:
            c = choices.get(item.name)
            if c is not None:
                seconds += c.seconds - c.comm_seconds
            else:
                seconds += item.batch * cost.matrix_seconds(item.rows, item.cols, item.element_size)
        if split:
            tp += sum(c.comm_seconds for c in split) - (len(split) - 1) * split[0].latency
    return seconds, tp


def unit_flops(
    calls: Sequence[Sequence[MatrixItem]],
    pricer: SplitPricer | None,
    *,
    method: str,
    steps: int,
    restarts: tuple[int, ...],
) -> float:
    """Newton–Schulz FLOPs per rank of ``calls``: :func:`dmuon.kernels.ns_flops` of each
    whole matrix, and a split call's count on the path the engine takes for it
    (:class:`~dmuon.optim.planner.parallel.SplitPricer`; the gather path runs the whole
    matrix on every rank of the row)."""
    flops = 0
    split_flops = 0.0
    for call in calls:
        if pricer is not None and call and any(i.name in pricer.lay.splits for i in call):
            split_flops += pricer(call).flops
            continue
        for i in call:
            flops += ns_flops(
                i.rows, i.cols, method=method, steps=steps, restarts=restarts, batch=i.batch
            )
    return flops + split_flops if split_flops else flops
