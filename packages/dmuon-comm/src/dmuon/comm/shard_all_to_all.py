"""Sharded path: all-to-all the shards of every matrix to its owner, and the results back.

With FSDP2 every rank holds a row shard (``Shard(0)``) of every matrix. One
all-to-all sends rank ``r``'s shard of matrix ``j`` to ``owner(j)``, which then
holds whole matrices to orthogonalise; the reverse all-to-all returns each rank
its shard of the results. Per rank and direction that moves ``(N−1)/N`` of the
rank's shards — the volume of one reduce-scatter, with no redundant
Newton–Schulz (Dion's megabatched all-to-all, Ahn et al. 2025, with owners from
the load balancer instead of contiguous blocks).

Shards follow ``torch.chunk`` along dim 0, as FSDP2 does: with ``c = ceil(rows/N)``
rank ``r`` holds rows ``[r·c, min((r+1)·c, rows))``, which can be shorter than
``c`` or empty. Every shard is padded to ``c`` rows computed from the *global*
shape, so every rank agrees on every split size without communicating: uneven
split sizes computed from local shapes are how such all-to-alls hang.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from dmuon.comm.handles import CommHandle
from dmuon.comm.items import MatrixItem
from dmuon.comm.owner_plan import OwnerPlan
from dmuon.comm.plan_collective import begin, buffer_device, check_owned, items_by_dtype
from dmuon.comm.process_groups import group_rank, group_size
from dmuon.comm.stats import CommStats

__all__ = ["shard_all_to_all", "shard_all_to_all_reverse", "shard_range"]


def shard_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s row shard under ``torch.chunk`` / FSDP2.

    Examples:
        >>> [shard_range(5, 4, r) for r in range(4)]  # chunk size 2; rank 3 is empty
        [(0, 2), (2, 2), (4, 1), (5, 0)]
    """
    if world_size < 1 or not 0 <= rank < world_size or rows < 0:
        raise ValueError(
            f"need rows ≥ 0, world_size ≥ 1 and 0 ≤ rank < world_size, got "
            f"rows={rows}, world_size={world_size}, rank={rank}"
        )
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def _padded_chunk(item: MatrixItem, n: int) -> tuple[int, int]:
    """(rows per padded chunk, elements per row) of ``item`` split over ``n`` ranks."""
    inner = math.prod(item.shape[1:])
    return -(-item.shape[0] // n), inner


def _volumes(per_rank: list[list[MatrixItem]], n: int) -> list[int]:
    """Elements of each rank's padded chunks (one dtype): the all-to-all's split sizes."""
    return [sum(math.prod(_padded_chunk(i, n)) for i in its) for its in per_rank]


def _all_to_all(
    name: str,
    recv: torch.Tensor,
    send: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    me: int,
    *,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    works: list[object],
) -> None:
    """Start the all-to-all of ``send`` into ``recv`` (a copy on one rank); record its bytes.

    This rank sends ``in_splits[r]`` elements to rank ``r`` and receives
    ``out_splits[r]`` from it; what it keeps for itself is not traffic.
    """
    n = len(out_splits)
    if n > 1:
        works.append(
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)
        )
    else:
        recv.copy_(send)
    elem = send.element_size()
    stats.record(
        name,
        collectives=int(n > 1),
        payload_bytes=send.numel() * elem,
        bytes_sent=(sum(in_splits) - in_splits[me]) * elem,
        bytes_received=(sum(out_splits) - out_splits[me]) * elem,
        calls=0,
    )


def _setup(plan: OwnerPlan, group: dist.ProcessGroup | None, op: str) -> tuple[int, int]:
    if plan.replicate_size != 1:
        raise ValueError(
            f"{op}: needs a plan over the shard group (replicate_size=1); with HSDP, plan "
            f"over the shard dimension, got replicate_size={plan.replicate_size}"
        )
    n = group_size(group)
    if n != plan.world_size:
        raise ValueError(
            f"{op}: the process group has {n} ranks but the plan was made for "
            f"world_size={plan.world_size}"
        )
    return n, group_rank(group)


def shard_all_to_all(
    shards: Mapping[str, torch.Tensor],
    plan: OwnerPlan,
    *,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    verify: bool = False,
    device: torch.device | str | None = None,
) -> CommHandle[dict[str, torch.Tensor]]:
    """Gather every matrix's row shards on its owner (one all-to-all per dtype).

    Rank ``r`` sends its shard of item ``j`` (padded to ``ceil(rows_j / N)`` rows)
    to ``owner(j)``; the owner concatenates the ``N`` shards in rank order and drops
    the padding: ``W_j = [S_{j,0}; S_{j,1}; …; S_{j,N−1}]``.

    Args:
        shards: this rank's shard of every item of the plan, shaped
            ``(length, *shape[1:])`` with ``length`` from :func:`shard_range` (any
            memory layout; they are copied into the send buffer).
        plan: the owner plan (``replicate_size`` 1), over the shard group.
        group: the group the matrices are sharded over; default the world.
        stats: where to record bytes; default :func:`~dmuon.comm.default_stats`.
        verify: agree across ranks on valid, matching inputs first (see
            :func:`~dmuon.comm.reduce_to_owners`).
        device: where the buffers live (default: the shards' device).

    Returns:
        A handle whose ``wait()`` gives ``{name: full matrix}`` for the items this
        rank owns (new tensors).

    Raises:
        ValueError: a group that does not match the plan, a missing shard, or a
            shard whose shape or dtype is not what the plan and the chunking rule
            give this rank.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners, shard_all_to_all
        >>> plan = plan_owners([MatrixItem("w", (3, 2))], 1)
        >>> shard_all_to_all({"w": torch.ones(3, 2)}, plan).wait()["w"].shape
        torch.Size([3, 2])
    """
    name = "shard_all_to_all"

    def check() -> tuple[int, int]:
        n, me = _setup(plan, group, name)
        for item in plan.items:
            if item.name not in shards:
                raise ValueError(f"{name}: no shard given for item {item.name!r}")
            t = shards[item.name]
            start, length = shard_range(item.shape[0], n, me)
            want = (length, *item.shape[1:])
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{name}: rank {me}'s shard of {item.name!r} (global shape {item.shape}) "
                    f"must have shape {want} (rows {start}:{start + length} under torch.chunk "
                    f"over {n} ranks), got {tuple(t.shape)}"
                )
            if t.dtype != item.dtype:
                raise ValueError(
                    f"{name}: shard of {item.name!r} has dtype {t.dtype}, "
                    f"the plan says {item.dtype}"
                )
        return n, me

    n, me, stats = begin(name, plan, group, check, verify=verify, stats=stats)
    works: list[object] = []
    finishers: list = []
    device = buffer_device(device, shards)
    for dtype, per_rank in items_by_dtype(plan, n):
        volume = _volumes(per_rank, n)
        if sum(volume) == 0:  # every shard empty (a tp shard of no columns): nothing moves,
            # and the owners' matrices are empty as well
            finishers.append((torch.empty(0, dtype=dtype, device=device), per_rank[me], 0))
            continue
        send = torch.empty(sum(volume), dtype=dtype, device=device)
        offset = 0
        for its in per_rank:
            for item in its:
                rows, inner = _padded_chunk(item, n)
                block = send[offset : offset + rows * inner].view(rows, inner)
                shard = shards[item.name].reshape(shards[item.name].shape[0], inner)
                block[: shard.shape[0]].copy_(shard)
                block[shard.shape[0] :].zero_()
                offset += rows * inner
        recv = torch.empty(n * volume[me], dtype=dtype, device=device)
        _all_to_all(
            name, recv, send, [volume[me]] * n, volume, me, group=group, stats=stats, works=works
        )
        finishers.append((recv, per_rank[me], volume[me]))

    def finish() -> dict[str, torch.Tensor]:
        full: dict[str, torch.Tensor] = {}
        for recv, mine, vol in finishers:
            blocks = recv.view(n, vol)
            offset = 0
            for item in mine:
                rows, inner = _padded_chunk(item, n)
                chunk = blocks[:, offset : offset + rows * inner].reshape(n * rows, inner)
                full[item.name] = chunk[: item.shape[0]].reshape(item.shape)
                offset += rows * inner
        return full

    return CommHandle(works, finish, what="shard all-to-all to owners", group=group)


def shard_all_to_all_reverse(
    results: Mapping[str, torch.Tensor],
    plan: OwnerPlan,
    *,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    verify: bool = False,
    device: torch.device | str | None = None,
) -> CommHandle[dict[str, torch.Tensor]]:
    """Send each owner's full results back as row shards (the reverse of :func:`shard_all_to_all`).

    The owner of item ``j`` cuts its result into ``N`` chunks of
    ``ceil(rows_j / N)`` rows (the last ones padded with zeros) and sends chunk ``r``
    to rank ``r``; every rank gets its shard of every item, unpadded.

    Args:
        results: the full result of every item this rank owns
            (``plan.names_of(rank)``), in the item's shape and dtype.
        plan: the owner plan (``replicate_size`` 1), over the shard group.
        group: the group the matrices are sharded over; default the world.
        stats: where to record bytes; default :func:`~dmuon.comm.default_stats`.
        verify: agree across ranks on valid, matching inputs first.
        device: where the buffers live. Default: the results' device. Pass it where
            this rank may own nothing of the plan: its buffers must be on the device
            every other rank's are (NCCL refuses CPU tensors).

    Returns:
        A handle whose ``wait()`` gives ``{name: this rank's shard}`` for every item
        (views into the receive buffer; shapes from :func:`shard_range`).

    Raises:
        ValueError: a group that does not match the plan, or a missing result or
            one whose shape or dtype differs from its item.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners, shard_all_to_all_reverse
        >>> plan = plan_owners([MatrixItem("w", (3, 2))], 1)
        >>> shard_all_to_all_reverse({"w": torch.ones(3, 2)}, plan).wait()["w"].shape
        torch.Size([3, 2])
    """
    name = "shard_all_to_all_reverse"

    def check() -> tuple[int, int]:
        n, me = _setup(plan, group, name)
        check_owned(name, plan, me, results, noun="result", missing="no result was given")
        return n, me

    n, me, stats = begin(name, plan, group, check, verify=verify, stats=stats)
    works: list[object] = []
    finishers: list = []
    device = buffer_device(device, results)
    for dtype, per_rank in items_by_dtype(plan, n):
        volume = _volumes(per_rank, n)
        if sum(volume) == 0:  # every result empty: each rank's shards are empty too
            finishers.append((torch.empty(0, dtype=dtype, device=device), per_rank))
            continue
        send = torch.empty(n * volume[me], dtype=dtype, device=device)
        blocks = send.view(n, volume[me])
        offset = 0
        for item in per_rank[me]:
            rows, inner = _padded_chunk(item, n)
            flat = results[item.name].reshape(item.shape[0], inner)
            region = blocks[:, offset : offset + rows * inner].view(n, rows, inner)
            for r in range(n):
                start, length = shard_range(item.shape[0], n, r)
                region[r, :length].copy_(flat[start : start + length])
                region[r, length:].zero_()
            offset += rows * inner
        recv = torch.empty(sum(volume), dtype=dtype, device=device)
        _all_to_all(
            name, recv, send, volume, [volume[me]] * n, me, group=group, stats=stats, works=works
        )
        finishers.append((recv, per_rank))

    def finish() -> dict[str, torch.Tensor]:
        mine: dict[str, torch.Tensor] = {}
        for recv, per_rank in finishers:
            offset = 0
            for its in per_rank:
                for item in its:
                    rows, inner = _padded_chunk(item, n)
                    _, length = shard_range(item.shape[0], n, me)
                    block = recv[offset : offset + rows * inner].view(rows, inner)
                    mine[item.name] = block[:length].view(length, *item.shape[1:])
                    offset += rows * inner
        return mine

    return CommHandle(works, finish, what="shard all-to-all back from owners", group=group)
