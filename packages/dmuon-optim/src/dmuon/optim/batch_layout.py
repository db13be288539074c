"""A group's matrices laid out in buckets of one shape, and their state: :class:`Entry`,
:class:`Bucket`, :func:`build_buckets`.

Every matrix of a group (after :mod:`dmuon.optim.layout`) goes into the bucket of
its ``(shape, dtype, device)``, so that a step runs the rule once per bucket on a
stacked batch (:func:`~dmuon.optim.batches.step_bucket`).

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
them back after.

The distributed engine reuses this with an owner filter: an owner builds buckets
of the matrices it owns only and runs the same rule on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dmuon.optim.layout import Block, MatrixLayout, matrix_layout
from dmuon.optim.matrix_split import MatrixSplit, local_tensor
from dmuon.optim.rules import Rule
from dmuon.optim.state_precision import state_dtype_of
from dmuon.optim.transforms import StateSpec


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
        offset: where the part of the parameter this rank steps sits in the whole
            parameter, ``()`` when it steps the whole of it: a tensor-parallel shard's
            ``(split.dim, split.offset)``, a local part's global offset (a rank's
            experts of a stack). Seeds stochastic rounding
            (:func:`~dmuon.optim.state_precision.rounding_seed`), so that distinct parts
            of one parameter draw distinct bits on their ranks.
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
    offset: tuple[int, ...] = ()
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
            offset = () if gathered or not shard else _part_offset(p, split)
            b.entries.append(Entry(i, p, layout, block, b.size, shard, offset))
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


def _part_offset(p: torch.Tensor, split: MatrixSplit | None) -> tuple[int, ...]:
    """Where the part of ``p`` this rank steps sits in ``p`` (:attr:`Entry.offset`): a
    split's ``(dim, offset)``; a DTensor's local tensor's global offset; ``()`` for the
    whole parameter (an offset of zeros: a replicated DTensor, or rank 0's part of a
    stack, which then draws the bits the whole stack does in one process)."""
    if split is not None:
        return (split.dim, split.offset)
    mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
    if mesh is None or placements is None:  # not a DTensor: the whole tensor
        return ()
    try:  # DTensor has no public accessor of its local tensor's global offset
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - a torch that moved it: parts share bits
        return ()
    _, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    return tuple(int(o) for o in offset) if any(offset) else ()


def _cuts_matrices(group: Mapping[str, Any]) -> bool:
    """Whether the group keys ``split_sizes`` or ``num_heads`` cut each parameter into
    several matrices."""
    heads = group.get("num_heads") or 1
    counts = tuple(heads) if isinstance(heads, (tuple, list)) else (heads,)
    return bool(group.get("split_sizes")) or any(int(h) != 1 for h in counts)
