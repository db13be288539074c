"""Scale a weight's rows in place wherever its values live: whole, or a DTensor's shard.

``W ← diag(s) W`` for a row-factor vector ``s`` of the *whole* weight's rows. A plain
tensor is scaled whole (replicated weights: every rank holds the same ``s`` and
scales alike). A DTensor (FSDP2's ``Shard(0)``, tensor parallelism's ``Shard(0)`` or
``Shard(1)``, ``Replicate``, on any mesh) scales its local values only, with the
entries of ``s`` for its local rows. Those are taken with the public
``distribute_tensor(s, mesh, placements, src_data_rank=None)``, which slices the
vector each rank already holds exactly as the weight's rows are sliced (uneven
shards included) and sends nothing: ``Shard(0)`` of the weight shards ``s``, every
other placement of the weight (a column shard, a replica) keeps all of ``s``.
"""

from __future__ import annotations

import torch

from dmuon.optim.engine.params import is_dtensor

__all__ = ["scale_rows_"]


@torch.no_grad()
def scale_rows_(tensor: torch.Tensor, factors: torch.Tensor) -> None:
    """``tensor[i, ...] *= factors[i]`` for every row ``i`` this rank holds.

    Args:
        tensor: a weight ``(rows, ...)`` or a bias ``(rows,)``; plain or DTensor.
        factors: ``(rows,)`` over the whole tensor's rows (the same on every rank).

    Raises:
        ValueError: ``factors`` does not match the rows, or a DTensor placement with
            no local rows to scale (``Partial``, a strided shard).

    Examples:
        >>> import torch
        >>> w = torch.ones(3, 2)
        >>> scale_rows_(w, torch.tensor([1.0, 0.5, 2.0]))
        >>> w[:, 0]
        tensor([1.0000, 0.5000, 2.0000])
    """
    if tuple(factors.shape) != (tensor.shape[0],):
        raise ValueError(
            f"factors of shape {tuple(factors.shape)} do not match the {tensor.shape[0]} rows "
            f"of a tensor of shape {tuple(tensor.shape)}"
        )
    if not is_dtensor(tensor):
        _mul_rows(tensor, factors)
        return
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = []
    for pl in tensor.placements:  # type: ignore[attr-defined]
        if type(pl) is Shard:
            placements.append(Shard(0) if pl.dim == 0 else Replicate())
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
    _mul_rows(local, part)


def _mul_rows(t: torch.Tensor, factors: torch.Tensor) -> None:
    f = factors.reshape(-1, *[1] * (t.dim() - 1))
    if t.dtype in (torch.float16, torch.bfloat16):
        # one rounding to the weight's dtype, not two (factor, then product)
        t.copy_(t.float() * f.float())
    else:
        t.mul_(f.to(t.dtype))
