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

Layouts :func:`whole_tensor` does not gather itself — a pending sum (``Partial``), or
two mesh dimensions sharding one tensor dimension (FSDP2 over tensor parallelism's
``_StridedShard``) — are left to ``full_tensor()``, whose wait is the process group's.
"""

from __future__ import annotations

from typing import Any

import torch

from dmuon.comm import shard_range, wait_work
from dmuon.comm.torch_compat import all_gather_single
from dmuon.optim.engine.params import is_dtensor

__all__ = ["gathers_itself", "shard_of", "whole_tensor"]


def gathers_itself(t: torch.Tensor) -> bool:
    """Whether :func:`whole_tensor` gathers the DTensor ``t`` with its own collectives:
    every placement ``Replicate()`` or a plain ``Shard(d)``, no two mesh dimensions
    sharding the same tensor dimension (``False`` for anything else, and plain tensors).

    Examples:
        >>> import torch
        >>> gathers_itself(torch.zeros(2))
        False
    """
    if not is_dtensor(t):
        return False
    from torch.distributed.tensor import Replicate, Shard

    dims: list[int] = []
    for pl in t.placements:  # type: ignore[attr-defined]
        if type(pl) is Shard:
            dims.append(pl.dim % t.dim())
        elif not isinstance(pl, Replicate):
            return False
    return len(dims) == len(set(dims))


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
    if not gathers_itself(t):
        return t.full_tensor()  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    local = t.to_local()  # type: ignore[attr-defined]
    for d, pl in enumerate(t.placements):  # type: ignore[attr-defined]
        n = int(mesh.size(d))
        if pl.is_replicate() or n == 1:
            continue
        dim = pl.dim % t.dim()
        what = (
            f"the all-gather of {name or 'a checkpoint tensor'!r} (Shard({dim}) over mesh "
            f"dim {names[d]!r})"
        )
        local = _gathered(local, dim, int(t.shape[dim]), mesh.get_group(d), n, what)
    return local


def _gathered(
    local: torch.Tensor, dim: int, size: int, group: Any, n: int, what: str
) -> torch.Tensor:
    """The ``n`` ranks' blocks of ``local`` along ``dim`` (``torch.chunk``'s split of
    ``size``, as DTensor's ``Shard``) put together: each padded to the largest, one
    all-gather, the padding cut off."""
    chunk = -(-size // n)
    moved = local.movedim(dim, 0)
    send = moved.new_zeros((chunk, *moved.shape[1:]))
    send.narrow(0, 0, moved.shape[0]).copy_(moved)
    out = send.new_empty((n * chunk, *moved.shape[1:]))
    wait_work(all_gather_single(out, send, group=group, async_op=True), what, group)
    blocks = out.view(n, chunk, *moved.shape[1:])
    parts = [blocks[r].narrow(0, 0, shard_range(size, n, r)[1]) for r in range(n)]
    return torch.cat(parts, dim=0).movedim(0, dim).contiguous()


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
