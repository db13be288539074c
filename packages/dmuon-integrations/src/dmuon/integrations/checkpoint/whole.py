"""DTensors made whole, and whole tensors cut to a DTensor's shard, under DMuon's deadline.

A checkpoint gathers tensor-parallel and FSDP2 tensors whole (the one-file
:func:`~dmuon.integrations.checkpoint.full_state_dict`, torchtitan's owners' rows) and
cuts whole tensors back to shards on load. DTensor's ``full_tensor()`` and
``distribute_tensor(..., src_data_rank=0)`` (the default, and what torch's
``set_model_state_dict(full_state_dict=True)`` calls) issue functional collectives
whose wait has no deadline: a rank that never joins the checkpoint holds the others
until the process group's own timeout (gloo: 30 minutes). Here:

* :func:`whole_tensor` gathers a DTensor with one all-gather per mesh dimension it is
  sharded on, issued asynchronously and waited by :func:`dmuon.comm.wait_work` under
  the current :func:`dmuon.comm.collective_timeout` (the checkpoint's,
  :func:`~dmuon.integrations.checkpoint.deadline.checkpoint_deadline`): a rank that does
  not come makes the others raise :class:`dmuon.comm.CollectiveError` naming the
  tensor. The gather only copies, so the result is ``full_tensor()``'s bitwise.
* :func:`shard_of` cuts a whole tensor every rank holds to this rank's shard, with no
  collective at all (``distribute_tensor(..., src_data_rank=None)``: the same values as
  a scatter from rank 0 when every rank holds the same whole tensor).

FSDP2 over tensor parallelism (a tensor dimension sharded over ``tp``, then over ``dp``:
``_StridedShard`` on ``dp``, ``Shard`` on ``tp``) is gathered the same way, over ``dp``
first. Layouts :func:`whole_tensor` does not gather itself are left to
``full_tensor()``, whose wait is the process group's: a pending sum (``Partial``: no
parameter or optimizer state is one; a sum, unlike a gather, is bitwise DTensor's only
when its all-reduces are DTensor's, over the same buffers in the same order) and any
other two or more mesh dimensions sharding one tensor dimension.
"""

from __future__ import annotations

import torch

from dmuon.comm import shard_range
from dmuon.comm.chunk_gather import all_gather_chunks
from dmuon.optim.engine.params import is_dtensor

__all__ = ["gathers_itself", "shard_of", "whole_tensor"]


def gathers_itself(t: torch.Tensor) -> bool:
    """Whether :func:`whole_tensor` gathers the DTensor ``t`` with its own collectives:
    every placement ``Replicate()`` or a plain ``Shard(d)``, each tensor dimension sharded
    over one mesh dimension, or over two as FSDP2 over tensor parallelism lays it out
    (:func:`_gathers`); ``False`` for anything else (a pending sum), and plain tensors.

    Examples:
        >>> import torch
        >>> gathers_itself(torch.zeros(2))
        False
    """
    return is_dtensor(t) and _gathers(t) is not None


def _gathers(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """The all-gathers that make the DTensor ``t`` whole, in order: ``(mesh dim, size of
    the tensor dimension it puts together)``; ``None`` for a layout left to
    ``full_tensor()``.

    A plain ``Shard(d)`` on mesh dimension ``i`` is one gather over ``i`` to the whole
    size. FSDP2 over tensor parallelism shards a dimension over ``tp`` first, then the
    ``tp`` shard over ``dp`` (DTensor writes it ``_StridedShard(d, split_factor=size of
    tp)`` on ``dp``, ``Shard(d)`` on ``tp``, ``dp`` outer): each rank holds
    ``torch.chunk``'s block of its ``tp`` block, so the gather over ``dp`` comes first, to
    this rank's ``tp`` block, then the one over ``tp``, to the whole.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = t.device_mesh  # type: ignore[attr-defined]
    placements = list(t.placements)  # type: ignore[attr-defined]
    by_dim: dict[int, list[int]] = {}
    for d, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        if not isinstance(pl, Shard | _StridedShard):  # a pending sum
            return None
        by_dim.setdefault(pl.dim % t.dim(), []).append(d)
    out: list[tuple[int, int]] = []
    for dim, dims in sorted(by_dim.items()):
        whole = int(t.shape[dim])
        if len(dims) == 1 and type(placements[dims[0]]) is Shard:
            out.append((dims[0], whole))
            continue
        if len(dims) != 2:
            return None
        outer, inner = placements[dims[0]], placements[dims[1]]
        n_inner = int(mesh.size(dims[1]))
        strided = type(outer) is _StridedShard and outer.split_factor == n_inner
        if not (strided and type(inner) is Shard):
            return None
        me_inner = int(mesh.get_local_rank(dims[1]))
        out.append((dims[0], shard_range(whole, n_inner, me_inner)[1]))
        out.append((dims[1], whole))
    return out


@torch.no_grad()
def whole_tensor(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """The whole tensor of ``t``: ``t`` itself for a plain tensor, ``t.full_tensor()``'s
    values for a DTensor, gathered over each sharded mesh dimension by an all-gather
    waited under the current deadline when :func:`gathers_itself`, by ``full_tensor()``
    otherwise.

    Every rank of ``t``'s mesh calls it for the same tensors in the same order.

    Args:
        t: a tensor or DTensor.
        name: what ``t`` is (a parameter's FQN and state key), for the errors.

    Raises:
        dmuon.comm.CollectiveError: a rank of the mesh did not join the gather in time.

    Examples:
        >>> import torch
        >>> x = torch.ones(2, 3)
        >>> whole_tensor(x) is x
        True
    """
    if not is_dtensor(t):
        return t
    gathers = _gathers(t)
    if gathers is None:
        return t.full_tensor()  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    local = t.to_local()  # type: ignore[attr-defined]
    placements = t.placements  # type: ignore[attr-defined]
    for d, size in gathers:
        n = int(mesh.size(d))
        if n == 1:
            continue
        pl = placements[d]
        dim = pl.dim % t.dim()
        strided = getattr(pl, "split_factor", None)  # _StridedShard's
        how = f"Shard({dim})" if strided is None else f"_StridedShard({dim}, {strided})"
        what = (
            f"the all-gather of {name or 'a checkpoint tensor'!r} ({how} over mesh "
            f"dim {names[d]!r})"
        )
        local = all_gather_chunks(local, dim, size, mesh.get_group(d), what)
    return local


def shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full``, a whole tensor every rank holds alike, as a DTensor laid out as ``like``
    (its mesh and placements), each rank cutting its own shard: no collective. A plain
    ``like`` gives ``full`` back.

    Examples:
        >>> import torch
        >>> x = torch.ones(2)
        >>> shard_of(x, torch.zeros(2)) is x
        True
    """
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full,
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        src_data_rank=None,  # every rank holds the whole: each slices its shard
    )
