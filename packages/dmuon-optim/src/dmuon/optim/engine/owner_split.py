"""Owner mode over a ``dp × tp`` mesh: dedicated parameters that are tensor-parallel shards.

A model parallelised with ``parallelize_module`` (``ColwiseParallel``: ``Shard(0)``,
``RowwiseParallel``: ``Shard(1)`` on a ``tp`` mesh dimension) holds its matrices as
DTensors. Owner mode plans their owners over the data-parallel ranks of each ``tp``
column (the ranks with this rank's ``tp`` index) **by the whole matrices' shapes**, so
every column plans the same owners even where an uneven split gives the columns
different local shapes. What travels over ``dp`` is this rank's shard:

* the reduction to the owner carries ``p.grad.to_local()`` (:func:`local_plan`: the
  plan with each item's local shape, which the buckets and the owner-rooted
  collectives are built from);
* the owner's ``tp`` row — the ranks with the owner's ``dp`` index, one per column —
  steps the matrix together, each rank its shard, with a
  :class:`~dmuon.optim.matrix_split.MatrixSplit` over ``tp`` (the Gram all-reduce of
  :func:`dmuon.kernels.tp_gram_newton_schulz`, or the gather path, or the gather of a
  rule that needs the whole matrix: :mod:`~dmuon.optim.engine.tensor_split`);
* the broadcast from the owner carries the new shard back over ``dp``.

Since every rank of a row owns the same matrices (one plan) and builds the same
batches from the whole shapes, the ranks of a ``tp`` group issue their ``tp``
collectives in one order.

Scalar parameters that are DTensors over ``tp`` (a colwise layer's bias, a
``SequenceParallel`` norm) are all-reduced (or reduced to their owner) by their
local parts over ``dp``; a gradient that is a pending sum over ``tp`` (``Partial``)
keeps its placements, and the step carries the sum out as DTensor arithmetic does.
A matrix replicated whole over ``tp`` (``Replicate()`` on every mesh dimension) travels
the same way, its local tensor being the whole matrix; its owner's ``tp`` row carries
out a pending sum before the rule (``OwnerEngine``). A split matrix's pending sum is
laid out as its shard before the reduction
(:func:`~dmuon.optim.engine.tensor_split.laid_out_as`): its local part is the whole
matrix's shape, not the shard's the buckets hold.

A DTensor parameter's local tensor cannot be made a view of a broadcast bucket
through public APIs (``to_local()`` hands out a new alias each call, and setting
``.data`` of a DTensor parameter replaces it), so unlike plain parameters its shard
is copied into the bucket before a broadcast and out of it after: one more copy of
each tensor-parallel shard per step, and its bucket's memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import MatrixItem, OwnerPlan
from dmuon.comm.process_groups import group_size
from dmuon.optim.engine.model_agreement import check_model_consistency
from dmuon.optim.engine.params import is_dtensor, subplan
from dmuon.optim.matrix_split import local_tensor

__all__ = ["as_gradient", "check_split_model", "local_item_shape", "local_plan"]


def local_item_shape(item: MatrixItem, p: torch.Tensor) -> tuple[int, ...]:
    """The shape that travels for ``item``: its planned shape with this rank's local part of
    ``p`` in place of the whole (a plain tensor: the planned shape itself).

    Examples:
        >>> import torch
        >>> local_item_shape(MatrixItem("w", (6, 4)), torch.zeros(6, 4))
        (6, 4)
    """
    if not is_dtensor(p):
        return tuple(item.shape)
    local = tuple(int(d) for d in local_tensor(p).shape)
    if len(local) < 2:
        return (1, math.prod(local))
    if len(item.shape) == 2 and len(local) > 2:  # a flattened stack or conv weight
        return (local[0], math.prod(local[1:]))
    return local


def local_plan(plan: OwnerPlan, params: Mapping[str, torch.Tensor]) -> OwnerPlan:
    """``plan`` with the local shape of every DTensor it covers (:func:`local_item_shape`);
    ``plan`` itself when it covers none. The owners stay the whole plan's: the buckets and
    the owner-rooted collectives of a ``tp`` column are built from it."""
    shapes = {
        item.name: local_item_shape(item, params[item.name])
        for item in plan.items
        if is_dtensor(params[item.name])
    }
    if not shapes:
        return plan
    return subplan(plan, plan.names, shapes)


def as_gradient(
    p: torch.Tensor, local: torch.Tensor, placements: Sequence[Any] | None = None
) -> torch.Tensor:
    """The gradient to set on ``p`` from the reduced local part ``local``: ``local`` shaped
    like ``p`` for a plain tensor; for a DTensor, a DTensor on ``p``'s mesh with
    ``placements`` (those its gradient had, e.g. ``Partial``; default ``p``'s), through the
    public ``DTensor.from_local``."""
    if not is_dtensor(p):
        return local.view(p.shape)
    from torch.distributed.tensor import DTensor

    shape = tuple(local_tensor(p).shape)
    return DTensor.from_local(
        local.view(shape),
        p.device_mesh,  # type: ignore[attr-defined]
        tuple(placements) if placements is not None else p.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


def check_split_model(
    plan: OwnerPlan,
    group: dist.ProcessGroup | None,
    tensor_groups: Sequence[dist.ProcessGroup],
) -> None:
    """Every rank holds the same model and plans the same owners, compared where they must
    agree: over ``group`` (the ``dp`` column, as plain owner mode) and over each ``tp``
    group of the split matrices — the ranks of a ``tp`` row step the same owned matrices
    together, so their whole plans (items and owners) must be identical. One comparison
    over the world instead when the two groups span it, so that a mismatch raises on every
    rank at once.

    Raises:
        ModelMismatchError: on every rank, naming the parameters that differ.
    """

    def over(size: int) -> OwnerPlan:
        # the same items and owners, as a plan over ``size`` ranks (what the comparison
        # checks the group against); over the world (d·t ranks) the owners, dp indices,
        # stay exact, over a tp group of t < d ranks they are folded onto it
        owners = tuple(o % size for o in plan.owners)
        return OwnerPlan(plan.items, owners, (), (0.0,) * size, size)

    world = group_size(None)
    tp = tensor_groups[0] if len(tensor_groups) == 1 else None
    if tp is not None and group_size(group) * group_size(tp) == world:
        check_model_consistency(over(world), None)
        return
    if group_size(group) > 1:
        check_model_consistency(plan, group)
    for g in tensor_groups:
        check_model_consistency(over(group_size(g)), g)
