"""Bucketing: same-shape matrices of a group stacked into one batch per step.

Every matrix of a group (after :mod:`dmuon.optim.layout`) goes into the bucket of
its ``(shape, dtype, device)``. A step runs the rule once per bucket on the stacked
batch — one ``torch.cat`` of the gradients, one batched Newton–Schulz call, two
``torch._foreach_*`` calls to apply — never a per-parameter loop of kernels.

State lives where a batch can use it without copies. A bucket whose parameters
are each one block (plain 2-D weights, conv weights, expert stacks, equal QKV
splits, per-head views, and weights stored ``(in, out)``: ``transposed``, the rule
sees their transposes) owns one stacked buffer per state key, ``(B, m, n)`` or
``(B, m)``, and ``optimizer.state[p][key]`` is a *view* of the parameter's slice of
it, in the parameter's shape (:meth:`~dmuon.optim.layout.MatrixLayout.state_view`; for
a ``transposed`` weight a transposed view, so not contiguous): the rule updates the
stacked buffer in place and the per-parameter state is current. Parameters cut into
blocks of different shapes (an unequal QKV split) keep their own state tensors, in
the parameter's shape; their buckets gather the blocks before the rule and scatter
them back after. (A ``transposed`` weight's gradient is still copied into the batch
and its update into the weight's columns: the rule needs ``(m, n)`` matrices.)
Both paths give the same numbers. When some parameters of a bucket have no
gradient, only the others are gathered — state of the rest is not touched.

The distributed engine reuses this with an owner filter: an owner builds buckets
of the matrices it owns only and runs the same rule on them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dmuon.optim.apply import apply_update
from dmuon.optim.layout import Block, MatrixLayout, matrix_layout
from dmuon.optim.matrix_split import MatrixSplit, local_tensor
from dmuon.optim.rules import Rule
from dmuon.optim.sparse_gradients import first_sparse, sparse_gradient_error
from dmuon.optim.state_precision import (
    compute_dtype_for,
    round_state_,
    rounding_seed,
    state_dtype_of,
)
from dmuon.optim.transforms import StateSpec
from dmuon.optim.vote import SignVote, local_vote

__all__ = [
    "Bucket",
    "Entry",
    "batch_runs",
    "build_buckets",
    "default_batch_elements",
    "state_shapes",
    "step_bucket",
]

# sink(entry, update, scale): where an engine takes an entry's update instead of
# applying it (see step_bucket).
Sink = Callable[["Entry", torch.Tensor, float], None]


@dataclass
class Entry:
    """One block of one parameter inside a bucket.

    Attributes:
        index: position of the parameter in its group.
        param: the parameter.
        layout: its matrix layout.
        block: which of its blocks.
        start: first matrix of this entry in the bucket's batch.
        local: the rule steps this rank's local part of the parameter (a DTensor's
            ``to_local()``): a tensor-parallel shard, or the whole experts of a stack
            split over its expert dimension.
        count: the number of matrices of this block (fixed with its layout and block,
            which do not change after construction).
        plain: the block is the whole parameter, one 2-D matrix: its gradient goes into
            a batch as it is (stacked) and its update is one matrix of the batch.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, build_buckets, get_rule, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
        ...                             torch.nn.Linear(32, 16))
        >>> group = DMuon(param_groups(model)).param_groups[0]  # the matrix group
        >>> buckets, state = build_buckets(group, get_rule("muon"), lambda p: {}, str)
        >>> e = buckets[0].entries[1]  # the second 32 × 32 weight
        >>> e.index, e.start, e.count
        (1, 1, 1)
    """

    index: int
    param: torch.Tensor
    layout: MatrixLayout
    block: Block
    start: int
    local: bool = False
    count: int = field(init=False, repr=False, compare=False)
    plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # read several times per entry and step: computed once
        self.count = self.layout.count(self.block)
        self.plain = self.layout.whole and self.count == 1 and len(self.layout.param_shape) == 2

    def tensor_block(self, t: torch.Tensor) -> torch.Tensor:
        """This block of a parameter-shaped tensor: ``t`` itself or a 4-D view."""
        return t if self.layout.whole else self.layout.block_view(t, self.block)

    def batch(self, t: torch.Tensor) -> torch.Tensor:
        """This block of a parameter-shaped tensor as ``(count, m, n)`` (a copy if needed).

        For reading only (gradients), so ``t`` may be non-contiguous.
        """
        m, n = self.layout.matrix_shape(self.block)
        if self.layout.whole:
            return t.reshape(self.count, m, n)
        return self.layout.block_view(t.contiguous(), self.block).reshape(self.count, m, n)


@dataclass
class Bucket:
    """Same-shape matrices of one group: the unit one rule call works on.

    Attributes:
        shape: ``(m, n)`` of every matrix.
        dtype: their dtype.
        device: their device.
        entries: the parameter blocks, in group order.
        size: number of matrices ``B``.
        buffers: the stacked state (``None`` when the bucket gathers per step).
        split: how its matrices are split over a tensor-parallel group (``None``:
            whole matrices). Then ``shape`` is this rank's shard's, the entries'
            parameters are DTensors and the rule sees their local shards.
        gathered: the matrices are split but the rule needs them whole (a link that is
            not :attr:`~dmuon.optim.transforms.Transform.splits`): each batch of shards is
            all-gathered over the group (``split.gather``), the rule runs on the whole
            matrices with whole state (the same on every rank of the group, which all
            compute alike), and each rank keeps its shard of the update. Then ``shape``
            and the state are the whole matrix's.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, build_buckets, get_rule, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
        ...                             torch.nn.Linear(32, 16))
        >>> group = DMuon(param_groups(model)).param_groups[0]  # the matrix group
        >>> buckets, state = build_buckets(group, get_rule("muon"), lambda p: {}, str)
        >>> [(b.shape, b.size) for b in buckets]
        [((32, 32), 2), ((16, 32), 1)]
        >>> buckets[0].buffers["momentum_buffer"].shape  # one stacked buffer per state key
        torch.Size([2, 32, 32])
    """

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device
    entries: list[Entry] = field(default_factory=list)
    size: int = 0
    buffers: dict[str, torch.Tensor] | None = None
    split: MatrixSplit | None = None
    gathered: bool = False

    @property
    def elements(self) -> int:
        """Entries of one whole matrix: what batches are cut by (the same on every rank of
        a tensor-parallel group, whatever its shard)."""
        return self.split.elements if self.split is not None else self.shape[0] * self.shape[1]


def state_shapes(rule: Rule, layout: MatrixLayout) -> dict[str, tuple[int, ...]]:
    """Per-parameter state keys of a matrix parameter and their shapes.

    Examples:
        >>> import torch
        >>> from dmuon.optim import get_rule, matrix_layout
        >>> layout = matrix_layout(torch.zeros(64, 32), {}, "w")
        >>> state_shapes(get_rule("muon"), layout)
        {'step': (), 'momentum_buffer': (64, 32)}
        >>> state_shapes(get_rule("normuon"), layout)["row_second_moment"]  # one per row
        (64,)
    """
    shapes: dict[str, tuple[int, ...]] = {"step": ()}
    for spec in rule.state_specs():
        shapes[spec.name] = layout.param_shape if spec.kind == "matrix" else layout.row_state_shape
    return shapes


def _copy_old(new: torch.Tensor, old: Mapping[str, Any], key: str) -> None:
    value = old.get(key)
    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(new.shape):
        new.copy_(value)


def build_buckets(
    group: Mapping[str, Any],
    rule: Rule,
    old_state: Callable[[torch.Tensor], Mapping[str, Any]],
    name_of: Callable[[int], str],
    include: Callable[[int, torch.Tensor], bool] | None = None,
    split_of: Callable[[torch.Tensor], MatrixSplit | None] | None = None,
    on_shard: Callable[[torch.Tensor], bool] | None = None,
    order: Sequence[int] | None = None,
) -> tuple[list[Bucket], dict[torch.Tensor, dict[str, torch.Tensor]]]:
    """Bucket a matrix group and create its state, eagerly, keeping old values.

    Args:
        group: a normalised matrix group.
        rule: its rule.
        old_state: the current state of a parameter (``{}`` if none); values of
            matching shape are copied into the new state.
        name_of: how to name parameter ``i`` of the group in errors.
        include: which parameters to bucket (default all; the distributed engine
            passes "owned by this rank").
        split_of: how a parameter is split over a tensor-parallel group (``None``, the
            default: whole). A split parameter is laid out, and its state shaped, by
            its local shard, and is batched only with matrices of the same whole
            shape, split and group, so every rank of the group runs the same batches
            in the same order, whatever the sizes of its shards.
        on_shard: whether a parameter is stepped on this rank's local part (default:
            the split ones). An expert stack split over its expert dimension is, with no
            ``split``: its local experts are whole matrices, laid out (and their state
            shaped) by the local tensor and batched with any other matrices of their
            shape; what each rank holds may differ (uneven shards), and no collective
            runs on them.
        order: the order in which the group's parameters are batched (default: the
            group's). The optimizer passes the order of their names, so that every rank
            stacks the same matrices in the same places whatever order it listed them in
            (a collective on a batch, Sign-Muon's vote or a tensor-parallel Gram
            all-reduce, pairs them by place).

    Returns:
        The buckets, in order of first appearance, and the new state per parameter.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, build_buckets, get_rule, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
        ...                             torch.nn.Linear(32, 16))
        >>> group = DMuon(param_groups(model)).param_groups[0]  # the matrix group
        >>> buckets, state = build_buckets(group, get_rule("muon"), lambda p: {}, str)
        >>> [(b.shape, b.size) for b in buckets]
        [((32, 32), 2), ((16, 32), 1)]
        >>> sorted(state[model[0].weight])
        ['momentum_buffer', 'step']
    """
    specs: tuple[StateSpec, ...] = rule.state_specs()
    buckets: dict[tuple[Any, ...], Bucket] = {}
    layouts: dict[int, MatrixLayout] = {}
    params = group["params"]
    for i in order if order is not None else range(len(params)):
        p = params[i]
        if include is not None and not include(i, p):
            continue
        split = split_of(p) if split_of is not None else None
        shard = split is not None or (on_shard is not None and on_shard(p))
        local = local_tensor(p) if shard else p
        if split is not None and split.local_shape is not None:  # gathered over dp: no tensor
            local = torch.empty(split.local_shape, dtype=p.dtype, device="meta")
        gathered = split is not None and not rule.splits
        if gathered:  # the rule runs on the whole matrix: laid out (and its state) whole
            assert split is not None
            local = torch.empty(split.shape, dtype=p.dtype, device="meta")
        if split is not None and group.get("transposed"):
            # a split names the dimension of the stored (in, out) weight, which the rule
            # sees transposed: its Gram all-reduce and shard offsets would be the wrong ones
            raise ValueError(
                f"{name_of(i)}: a weight stored (in, out) (the group key 'transposed', "
                "Hugging Face's Conv1D) is split over a tensor-parallel group; DMuon does not "
                "step such a split yet. Replicate it over the tensor-parallel dimension, or "
                "store it (out, in) as nn.Linear does"
            )
        if split is not None and _cuts_matrices(group):
            # decided from the group, the same on every rank of the split's group: the
            # shards' layouts differ (uneven, empty) and same-shape heads merge into one
            # block, so a layout would let some ranks (or all: per-head matrices of a
            # shard, their Gram matrices summed over the group) step it wrongly
            raise ValueError(
                f"{name_of(i)}: split_sizes and num_heads cut a matrix into blocks, which its "
                "tensor-parallel shards do not hold whole; drop them for this parameter "
                "(give it its own param group)"
            )
        layout = matrix_layout(local, dict(group), name_of(i))
        if split is not None and not layout.blocks and layout.flat[0] == 1:
            # An empty shard of an uneven split (a dimension smaller than the group, as
            # torch.chunk cuts it) holds no matrix, but its rank still takes part in
            # every collective of the group's batch: it is one empty matrix.
            _, M, _ = layout.flat
            layout = MatrixLayout(layout.param_shape, layout.flat, (Block(0, M, 1, M),), None)
        if split is not None and not layout.whole:
            raise ValueError(
                f"{name_of(i)}: split_sizes, num_heads and flatten cut a matrix into blocks, "
                "which its tensor-parallel shards do not hold whole; drop them for this "
                "parameter (give it its own param group)"
            )
        layouts[i] = layout
        for block in layout.blocks:
            shape = layout.matrix_shape(block)
            key = (shape, p.dtype, p.device) if split is None else (split.key, p.dtype, p.device)
            if key not in buckets:
                buckets[key] = Bucket(shape, p.dtype, p.device, split=split, gathered=gathered)
            b = buckets[key]
            b.entries.append(Entry(i, p, layout, block, b.size, shard))
            b.size += layout.count(block)

    new_state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for i in layouts:
        p = group["params"][i]
        old = old_state(p)
        step = torch.zeros((), dtype=torch.float32)
        _copy_old(step, old, "step")
        new_state[p] = {"step": step}

    for b in buckets.values():
        if not all(e.layout.stacks for e in b.entries):
            continue
        m, n = b.shape
        # group["state_dtype"] or the parameters' (fp32 for fp16 parameters' squares)
        b.buffers = {
            s.name: torch.zeros(
                s.batch_shape(b.size, m, n),
                dtype=state_dtype_of(group, b.dtype, s),
                device=b.device,
            )
            for s in specs
        }
        for e in b.entries:
            shapes = state_shapes(rule, e.layout)
            for s in specs:
                piece = b.buffers[s.name][e.start : e.start + e.count]
                view = e.layout.state_view(piece, shapes[s.name])
                _copy_old(view, old_state(e.param), s.name)
                new_state[e.param][s.name] = view

    for i, layout in layouts.items():
        p = group["params"][i]
        shapes = state_shapes(rule, layout)
        for s in specs:
            if s.name not in new_state[p]:
                dtype = state_dtype_of(group, p.dtype, s)
                t = torch.zeros(shapes[s.name], dtype=dtype, device=p.device)  # local
                _copy_old(t, old_state(p), s.name)
                new_state[p][s.name] = t
    return list(buckets.values()), new_state


def _cuts_matrices(group: Mapping[str, Any]) -> bool:
    """Whether the group keys ``split_sizes`` or ``num_heads`` cut each parameter into
    several matrices."""
    heads = group.get("num_heads") or 1
    counts = tuple(heads) if isinstance(heads, (tuple, list)) else (heads,)
    return bool(group.get("split_sizes")) or any(int(h) != 1 for h in counts)


def _state_block(b: Bucket, e: Entry, spec: StateSpec, st: Mapping[str, torch.Tensor]):
    """A writable view of entry ``e``'s slice of state ``spec``."""
    if b.buffers is not None:
        return b.buffers[spec.name][e.start : e.start + e.count]
    t = st[spec.name]
    if e.layout.whole:
        return t
    if spec.kind == "matrix":
        return e.layout.block_view(t, e.block)
    return e.layout.row_block_view(t, e.block)


def default_batch_elements(device: torch.device | str) -> int:
    """How many matrix entries one batched rule call may hold, by device.

    On a GPU one call should hold every matrix of a shape (launch overhead,
    occupancy). On a CPU the matmuls of one large matrix already keep the cores
    busy, and stacking more only streams the batch through DRAM instead of the
    caches: on the 2-core CI machine (1 thread), 32 stacked 2048 × 512 matrices took
    1.27× ``torch.optim.Muon``'s per-matrix loop, and 0.79× when cut into one
    matrix per call, while 32 small 128 × 512 ones took 0.46× in calls of 2²⁰
    entries and 0.91× in calls of one. CPU batches are therefore capped at 2²⁰
    entries (4 MiB of fp32): large matrices run one by one, small ones by the
    dozen.

    Examples:
        >>> default_batch_elements("cpu")
        1048576
    """
    return 1 << 20 if torch.device(device).type == "cpu" else 1 << 62


def batch_runs(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """How a bucket's entries are cut into batched rule calls: the indices of ``sizes``
    in consecutive runs of at most ``limit`` in total (matrix entries), at least one
    index each (an entry larger than ``limit`` is a run of its own).

    :func:`step_bucket` batches by it, and the planner counts the rule calls and the
    sign votes it prices by it (:mod:`dmuon.optim.planner.rule_calls`,
    :mod:`dmuon.optim.planner.traffic`).

    Examples:
        >>> batch_runs([4, 4, 4, 9, 1], 8)
        [[0, 1], [2], [3], [4]]
    """
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, c in enumerate(sizes):
        if cur and size + c > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += c
    if cur:
        out.append(cur)
    return out


def _chunks(part: list[Entry], per_entry: int, limit: int) -> list[list[Entry]]:
    """Consecutive runs of ``part`` holding at most ``limit`` entries (at least one each)."""
    return [
        [part[i] for i in run] for run in batch_runs([e.count * per_entry for e in part], limit)
    ]


def active_entries(b: Bucket, grads: Mapping[torch.Tensor, torch.Tensor] | None) -> list[Entry]:
    """The entries of ``b`` that have a gradient (``param.grad``, or a key of ``grads``)."""
    if grads is None:
        return [e for e in b.entries if e.param.grad is not None]
    return [e for e in b.entries if e.param in grads]


def _refuse_sparse(
    active: list[Entry], grads: Mapping[torch.Tensor, torch.Tensor] | None, group: Mapping[str, Any]
) -> None:
    """Raise, naming the parameter, if an entry of ``active`` has a sparse gradient."""
    i = first_sparse(e.param.grad if grads is None else grads[e.param] for e in active)
    if i is not None:
        e = active[i]
        names = group.get("param_names")
        name = names[e.index] if names is not None and e.index < len(names) else e.index
        raise sparse_gradient_error(f"parameter {name!r} (shape {tuple(e.param.shape)})")


@torch.no_grad()
def step_bucket(
    b: Bucket,
    group: Mapping[str, Any],
    rule: Rule,
    state: Mapping[torch.Tensor, Mapping[str, torch.Tensor]],
    vote: SignVote = local_vote,
    max_batch_elements: int | None = None,
    *,
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    sink: Sink | None = None,
    timings: dict[str, float] | None = None,
    active: list[Entry] | None = None,
) -> int:
    """Run ``rule`` on the entries of ``b`` that have a gradient and apply the update.

    Entries whose parameter has no gradient are skipped: neither their weights nor
    their state change. With a rule that reads the step count, entries at different
    counts run as separate batches. A batch holds at most ``max_batch_elements``
    matrix entries (default :func:`default_batch_elements`); every transform acts
    on each matrix independently, so how a bucket is cut changes no number.

    The distributed engine uses three hooks: ``grads`` maps a parameter to the
    gradient to use instead of ``param.grad`` (a parameter missing from it is
    skipped), e.g. the whole matrix an owner gathered from the shards of a
    sharded parameter; ``sink(entry, update, scale)`` receives each entry's
    update, ``(count, m, n)``, instead of having it applied (the caller applies
    ``W ← W·(1 − lr·wd) − lr·scale·update`` where the weight lives); ``timings``
    accumulates the seconds spent in the rule (``"rule"``) and in applying
    (``"apply"``). ``active``: the entries of ``b`` that have a gradient (``p.grad``, or
    in ``grads``), in bucket order, when the caller has listed them already
    (:func:`~dmuon.optim.stepping.step_matrices`); ``None``: listed here.

    Returns:
        The number of matrices the rule ran on.

    Raises:
        RuntimeError: an entry's gradient is sparse (named), when ``active`` is
            ``None``; with ``active`` given, the caller has checked (``DMuon.step``
            does, before any engine steps).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, build_buckets, get_rule, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
        ...                             torch.nn.Linear(32, 16))
        >>> group = DMuon(param_groups(model)).param_groups[0]  # the matrix group
        >>> buckets, state = build_buckets(group, get_rule("muon"), lambda p: {}, str)
        >>> model[0](torch.randn(4, 32)).sum().backward()  # a gradient for layer 0 only
        >>> step_bucket(buckets[0], group, get_rule("muon"), state)  # layer 1 is skipped
        1
        >>> [bool(state[m.weight]["momentum_buffer"].any()) for m in model[:2]]
        [True, False]
    """
    if active is None:  # called on its own (DMuon.step refused a sparse gradient before)
        active = active_entries(b, grads)
        _refuse_sparse(active, grads, group)
    if not active:
        return 0
    if rule.uses_step:
        parts: dict[int, list[Entry]] = {}
        for e in active:
            parts.setdefault(int(state[e.param]["step"].item()), []).append(e)
        batches = list(parts.items())
    else:
        batches = [(int(state[active[0].param]["step"].item()), active)]
    limit = default_batch_elements(b.device) if max_batch_elements is None else max_batch_elements
    ran = 0
    for step, part in batches:
        for chunk in _chunks(part, b.elements, limit):
            _run_batch(b, chunk, group, rule, state, step, vote, grads, sink, timings)
            ran += sum(e.count for e in chunk)
    return ran


def _run_batch(
    b: Bucket,
    part: list[Entry],
    group: Mapping[str, Any],
    rule: Rule,
    state: Mapping[torch.Tensor, Mapping[str, torch.Tensor]],
    step: int,
    vote: SignVote,
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    sink: Sink | None = None,
    timings: dict[str, float] | None = None,
) -> None:
    t0 = time.perf_counter()
    specs = rule.state_specs()
    m, n = b.shape
    source = [e.param.grad if grads is None else grads[e.param] for e in part]
    # the rule sees this rank's shards (matrix_split.py) or its local experts
    source = [
        local_tensor(g) if e.local else g  # type: ignore[arg-type]
        for e, g in zip(part, source, strict=True)
    ]
    if b.gathered:  # the whole matrices from every rank's shards (see Bucket.gathered)
        assert b.split is not None and b.split.gather is not None
        shards = torch.stack([g.reshape(g.shape[-2], g.shape[-1]) for g in source])  # type: ignore[union-attr]
        G = b.split.gather(shards)
    elif len(part) > 1 and all(
        e.plain and g.shape == b.shape  # type: ignore[union-attr]
        for e, g in zip(part, source, strict=True)
    ):  # whole (m, n) matrices: stacked, one copy (what cat of their (1, m, n) views gives)
        G = torch.stack(source)  # type: ignore[arg-type]
    else:
        batch = [e.batch(g) for e, g in zip(part, source, strict=True)]  # type: ignore[arg-type]
        G = batch[0] if len(batch) == 1 else torch.cat(batch)
    consecutive = all(nxt.start == cur.start + cur.count for cur, nxt in itertools.pairwise(part))
    views: dict[str, list[torch.Tensor]] = {}
    if b.buffers is not None and consecutive:
        # the entries' state is one contiguous slice of the stacked buffers
        lo, hi = part[0].start, part[-1].start + part[-1].count
        st = {name: buf[lo:hi] for name, buf in b.buffers.items()}
    else:
        views = {s.name: [_state_block(b, e, s, state[e.param]) for e in part] for s in specs}
        st = {
            s.name: torch.cat(
                [
                    v.reshape((e.count, m, n) if s.kind == "matrix" else (e.count, m))
                    for v, e in zip(views[s.name], part, strict=True)
                ]
            )
            for s in specs
        }
    split = None if b.gathered else b.split
    # state_dtype None, or the parameters' own dtype and already wide: st updated in place
    if group.get("state_dtype") is None or (
        compute_dtype_for(b.dtype) == b.dtype == state_dtype_of(group, b.dtype)
    ):
        U, scale = rule.update(G, st, group, step=step, vote=vote, split=split)
    else:  # low-precision state: upcast on read, math wide, round on write
        wide_dtype = compute_dtype_for(b.dtype)
        wide = {k: v.to(wide_dtype) for k, v in st.items()}
        U, scale = rule.update(G.to(wide_dtype), wide, group, step=step, vote=vote, split=split)
        U = U.to(b.dtype)
        rounding = group.get("state_rounding") or "nearest"
        # by step, parameter and block: the same bits in every mode and batch cut
        seeds = [(rounding_seed(step, e.index, e.block.row_start, b.shape), e.count) for e in part]
        for k, v in st.items():
            round_state_(v, wide[k], rounding, seeds)
    if b.gathered:  # this rank's shard of every whole update
        assert b.split is not None
        d = b.split.dim
        U = U.narrow(d, b.split.offset, source[0].shape[d])  # type: ignore[union-attr]
    counts = [e.count for e in part]
    for s in specs if views else ():
        chunks = st[s.name].split(counts)
        torch._foreach_copy_(
            views[s.name],
            [c.reshape(v.shape) for c, v in zip(chunks, views[s.name], strict=True)],
        )
    t1 = time.perf_counter()
    if sink is not None:
        for e, u in zip(part, U.split(counts), strict=True):
            sink(e, u, scale)
    else:
        weights = [local_tensor(e.param) if e.local else e.param for e in part]
        targets = [e.tensor_block(w) for e, w in zip(part, weights, strict=True)]
        if all(e.plain and t.shape == U.shape[1:] for e, t in zip(part, targets, strict=True)):
            updates = list(U.unbind(0))  # each entry one matrix of the batch, in its shape
        else:
            updates = [c.reshape(t.shape) for c, t in zip(U.split(counts), targets, strict=True)]
        apply_update(
            targets,
            updates,
            lr=float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            scale=scale,
            cautious=bool(group.get("cautious_weight_decay", False)),
        )
    if timings is not None:
        t2 = time.perf_counter()
        timings["rule"] = timings.get("rule", 0.0) + (t1 - t0)
        timings["apply"] = timings.get("apply", 0.0) + (t2 - t1)
