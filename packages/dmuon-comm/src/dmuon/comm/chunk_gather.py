"""A tensor in ``torch.chunk`` blocks over ranks: put back together by one padded
all-gather, or cut into padded blocks for one scatter or reduce-scatter.

A tensor of ``size`` entries along ``dim`` split over the ``n`` ranks of a group as
``torch.chunk`` (and DTensor's ``Shard``) splits it — every block ``⌈size/n⌉`` long, the
last ones shorter or empty (:func:`dmuon.comm.shard_range`) — is made whole by one
``all_gather_single`` of equal blocks: each rank pads its own to ``⌈size/n⌉``, the
gathered blocks are cut back to their lengths and concatenated. The wait is
:func:`dmuon.comm.wait_work`'s, under the current deadline. Used by the tensor-parallel
gather path of the Newton–Schulz chain and by checkpoints making a shard whole.
:func:`padded_chunks` is the other direction: the whole tensor's ``n`` blocks, each
padded with zeros to ``⌈size/n⌉``, stacked for a collective of equal blocks (the
checkpoint's scatter of owner-held state, tensor parallelism's reduce-scatter of a
pending sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.shard_all_to_all import shard_range
from dmuon.comm.stats import CommStats
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["all_gather_chunks", "padded_chunks"]


def all_gather_chunks(
    local: torch.Tensor,
    dim: int,
    size: int,
    group: dist.ProcessGroup,
    what: str,
    *,
    stats: CommStats | None = None,
    stats_name: str = "",
) -> torch.Tensor:
    """The whole tensor whose ``torch.chunk`` blocks along ``dim`` the ranks of ``group``
    hold, this rank's being ``local``.

    Args:
        local: this rank's block (its length along ``dim`` is
            ``shard_range(size, n, rank)[1]``; the other dimensions equal on every rank).
        dim: the split dimension of ``local``.
        size: the whole length along ``dim``.
        group: the ranks holding the blocks, in block order.
        what: the collective, for :class:`dmuon.comm.CollectiveError`.
        stats: where the all-gather's bytes are recorded (under ``stats_name``); ``None``:
            not recorded.
        stats_name: the op name to record under.

    Returns:
        A new contiguous tensor, ``size`` long along ``dim``.

    Raises:
        dmuon.comm.CollectiveError: a rank did not join in time.
    """
    n = dist.get_world_size(group)
    dim = dim % local.dim()
    pad = list(local.shape)
    pad[dim] = -(-size // n)
    send = local.new_zeros(pad)
    send.narrow(dim, 0, local.shape[dim]).copy_(local)
    out = local.new_empty((n * pad[0], *pad[1:]))  # the ranks' blocks one after another
    if stats is not None:
        nbytes = send.numel() * send.element_size()  # the input, as record_collective counts
        stats.record_collective(stats_name, "all_gather", nbytes=nbytes, world_size=n)
    wait_work(all_gather_single(out, send, group=group, async_op=True), what, group)
    blocks = out.view(n, *pad)
    return torch.cat([blocks[r].narrow(dim, 0, shard_range(size, n, r)[1]) for r in range(n)], dim)


def padded_chunks(whole: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``whole``'s ``n`` ``torch.chunk`` blocks along ``dim``, each padded with zeros to
    ``⌈size/n⌉`` along ``dim``, stacked: a new contiguous tensor of shape
    ``(n, *block)``, whose row ``r`` is rank ``r``'s block (uneven and empty blocks
    included, as DTensor's ``Shard`` cuts them; :func:`dmuon.comm.shard_range`).

    Examples:
        >>> import torch
        >>> padded_chunks(torch.arange(1, 6), 0, 3)  # blocks of 2, 2, 1 entries
        tensor([[1, 2],
                [3, 4],
                [5, 0]])
        >>> padded_chunks(torch.ones(2, 3), 1, 2).shape  # dim 1: blocks of 2 columns
        torch.Size([2, 2, 2])
    """
    dim = dim % whole.dim()
    size = int(whole.shape[dim])
    block = list(whole.shape)
    block[dim] = -(-size // n)
    out = whole.new_zeros((n, *block))
    for r in range(n):
        start, length = shard_range(size, n, r)
        out[r].narrow(dim, 0, length).copy_(whole.narrow(dim, start, length))
    return out
