"""The optimizer state of a matrix stepped on its tensor-parallel shards, as checkpoints see it.

In ``single`` mode a matrix split by rows or columns over a mesh dimension is
stepped on its shards (:mod:`dmuon.optim.engine.tensor_split`), and its matrix-shaped
state (momentum, second moments) is this rank's shard: a plain tensor of the
shard's shape. Saved as it is, every rank would write a different tensor under the
same key, and DCP, which takes a plain tensor for a replicated one, would keep one
of them. A checkpoint therefore sees such state as a DTensor laid out like its
parameter (:func:`as_saved`): DCP writes every shard once and reshards on load (to
another tensor-parallel degree, or to one process), and the optimizer gets back the
local shard (:func:`as_loaded`).

The same holds for an expert stack ``(E, m, n)`` whose experts are split over a mesh
dimension (expert parallelism): each rank's state is that of its own experts,
``(E_local, m, n)``, and per-row state ``(E_local, m)``; both are saved as DTensors of
the whole stack's ``(E, m, n)`` and ``(E, m)``, split like the parameter.
"""

from __future__ import annotations

import torch

from dmuon.optim.engine.params import is_dtensor

__all__ = ["as_loaded", "as_saved"]


def as_saved(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value``, a state tensor of ``param``, in the form a checkpoint stores.

    A plain tensor of the shape of a DTensor parameter's local shard becomes a
    DTensor with the parameter's mesh, placements and global shape. Per-row state
    (NorMuon's ``row_second_moment``) of a matrix split by rows becomes the DTensor of
    the whole column of rows, split the same way; of a matrix split by columns it is
    whole and the same on every rank, and stays as it is. Per-row state of a stack
    split over a leading (expert) dimension, shaped like its local shard without the
    last dimension, becomes the DTensor of the whole stack's rows. Anything else (a scalar
    ``step``, a DTensor, the state of a plain parameter) is returned as it is.

    Raises:
        NotImplementedError: a plain, non-scalar state tensor of a DTensor parameter
            of none of these shapes.

    Examples:
        >>> import torch
        >>> m = torch.zeros(3, 4)
        >>> as_saved(m, torch.nn.Parameter(torch.ones(3, 4))) is m
        True
    """
    if is_dtensor(value) or not is_dtensor(param) or value.dim() == 0:
        return value
    shape, local = tuple(value.shape), tuple(param.to_local().shape)  # type: ignore[attr-defined]
    whole = tuple(param.shape)
    if shape == whole and local != whole:
        return value  # whole: an owner's state, or a rule that gathers the shards
    rows_split = local[:1] != whole[:1]
    per_row = value.dim() == 1 and param.dim() == 2
    if per_row and shape == whole[:1]:
        # per-row state of whole rows (a split by columns), or whole state of a rule that
        # gathers the shards: the same on every rank
        return value
    target: tuple[int, ...]
    stride: tuple[int, ...]
    per_expert_row = value.dim() == param.dim() - 1 > 1 and shape == local[:-1]
    if per_row and rows_split and shape == local[:1]:
        target, stride = whole[:1], (1,)  # split like the rows (the parameter's Shard(0))
    elif shape == local:
        target, stride = whole, param.stride()
    elif per_expert_row and local[-1] == whole[-1]:  # the stack's rows, split like it
        target = whole[:-1]
        stride = torch.empty(target, device="meta").stride()
    else:
        raise NotImplementedError(
            f"optimizer state of shape {shape} for a DTensor parameter of local shape "
            f"{local} (global {whole}, placements {tuple(param.placements)}): a "  # type: ignore[attr-defined]
            "checkpoint can store state shaped like the parameter's shard, or per row, only"
        )
    from torch.distributed.tensor import DTensor, Replicate

    placements = tuple(param.placements)  # type: ignore[attr-defined]
    if len(target) < param.dim():  # per-row state: a split of the columns holds whole rows
        placements = tuple(
            Replicate()
            if isinstance(getattr(pl, "dim", None), int) and pl.dim >= len(target)
            else pl
            for pl in placements
        )
    return DTensor.from_local(
        value,
        param.device_mesh,  # type: ignore[attr-defined]
        placements,
        run_check=False,
        shape=torch.Size(target),
        stride=stride,
    )


def as_loaded(value: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``value`` read from a checkpoint, in the form the optimizer holds ``current`` in:
    the local shard of a DTensor the optimizer holds as a plain tensor.

    Examples:
        >>> import torch
        >>> v = torch.ones(2)
        >>> as_loaded(v, torch.zeros(2)) is v
        True
    """
    if is_dtensor(value) and not is_dtensor(current):
        return value.to_local()  # type: ignore[attr-defined]
    return value
