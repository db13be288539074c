"""Scale a weight's rows in place wherever its values live: whole, or a DTensor's shard.

``W ← diag(s) W`` for a row-factor vector ``s`` of the *whole* weight's rows
(``dim=1``: ``W ← W diag(s)``, the columns of a weight stored ``(in, out)`` such as
GPT-2's ``Conv1D``; "rows" below are then its columns). A plain
tensor is scaled whole (replicated weights: every rank holds the same ``s`` and
scales alike). A DTensor (FSDP2's ``Shard(0)``, tensor parallelism's ``Shard(0)`` or
``Shard(1)``, ``Replicate``, on any mesh) scales its local values only, with the
entries of ``s`` for its local rows. Those are taken with the public
``distribute_tensor(s, mesh, placements, src_data_rank=None)``, which slices the
vector each rank already holds exactly as the weight's rows are sliced (uneven
shards included) and sends nothing: ``Shard(0)`` of the weight shards ``s``, every
other placement of the weight (a shard of another dimension, a replica) keeps all of
``s`` (with ``dim=1``: ``Shard(1)`` of the weight shards ``s``).
"""

from __future__ import annotations

import torch

from dmuon.optim.engine.params import is_dtensor

__all__ = ["scale_rows_"]


@torch.no_grad()
def scale_rows_(tensor: torch.Tensor, factors: torch.Tensor, *, dim: int = 0) -> None:
    """``tensor[i, ...] *= factors[i]`` for every row ``i`` this rank holds.

    Args:
        tensor: a weight ``(rows, ...)`` or a bias ``(rows,)``; plain or DTensor.
        factors: ``(rows,)`` over the whole tensor's rows (the same on every rank).
        dim: the dimension ``factors`` runs along: 0, or 1 for the columns of a
            matrix (``tensor[:, j] *= factors[j]``).

    Raises:
        ValueError: ``factors`` does not match the rows, ``dim`` is not a dimension
            of ``tensor`` (0, or 1 for a matrix), or a DTensor placement with no local
            rows to scale (``Partial``, a strided shard).

    Examples:
        >>> import torch
        >>> w = torch.ones(3, 2)
        >>> scale_rows_(w, torch.tensor([1.0, 0.5, 2.0]))
        >>> w[:, 0]
        tensor([1.0000, 0.5000, 2.0000])
        >>> scale_rows_(w, torch.tensor([1.0, 4.0]), dim=1)  # columns
        >>> w[0]
        tensor([1., 4.])
    """
    if dim not in (0, 1) or dim >= tensor.dim():
        raise ValueError(
            f"dim must be 0, or 1 for a matrix; got dim={dim!r} for a tensor of shape "
            f"{tuple(tensor.shape)}"
        )
    if tuple(factors.shape) != (tensor.shape[dim],):
        what = "rows" if dim == 0 else "columns"
        raise ValueError(
            f"factors of shape {tuple(factors.shape)} do not match the {tensor.shape[dim]} "
            f"{what} of a tensor of shape {tuple(tensor.shape)}"
        )
    if not is_dtensor(tensor):
        _mul_rows(tensor, factors, dim)
        return
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = []
    for pl in tensor.placements:  # type: ignore[attr-defined]
        if type(pl) is Shard:
            placements.append(Shard(0) if pl.dim == dim else Replicate())
        elif isinstance(pl, Replicate):
            placements.append(Replicate())
        else:
            raise ValueError(
                f"cannot scale the rows of a DTensor placed {tensor.placements} "  # type: ignore[attr-defined]
                f"(placement {pl}): only Shard(dim) and Replicate() hold whole values"
            )
    local = tensor.to_local()  # type: ignore[attr-defined]
    part = distribute_tensor(
        factors.to(local.device),
        tensor.device_mesh,  # type: ignore[attr-defined]
        placements,
        src_data_rank=None,  # every rank holds the whole vector: slice, no traffic
    ).to_local()
    _mul_rows(local, part, dim)


def _mul_rows(t: torch.Tensor, factors: torch.Tensor, dim: int) -> None:
    f = factors.reshape(-1, *[1] * (t.dim() - 1 - dim))
    if t.dtype in (torch.float16, torch.bfloat16):
        # one rounding to the weight's dtype, not two (factor, then product)
        t.copy_(t.float() * f.float())
    else:
        t.mul_(f.to(t.dtype))
