"""Replicated path: every owner's updates to every rank, in one all-gather per dtype."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from dmuon.comm.handles import CommHandle
from dmuon.comm.owner_plan import OwnerPlan
from dmuon.comm.plan_collective import begin, buffer_device, check_owned, items_by_dtype
from dmuon.comm.process_groups import group_rank, group_size
from dmuon.comm.stats import CommStats
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["all_gather_updates"]


def all_gather_updates(
    updates: Mapping[str, torch.Tensor],
    plan: OwnerPlan,
    *,
    group: dist.ProcessGroup | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    stats: CommStats | None = None,
    verify: bool = False,
    device: torch.device | str | None = None,
) -> CommHandle[dict[str, torch.Tensor]]:
    """Give every rank the update of every item, each computed by its owner.

    The replicated mode (stock DDP): gradients were all-reduced, each owner
    computed the updates of its own items, and one ``dist.all_gather_single`` per
    dtype spreads them. Ranks own different volumes, so each rank's chunk is
    padded to the largest per-rank volume ``V = max_r Σ_{j owned by r} numel_j``,
    known to all ranks from the plan (gloo has no uneven all-gather): the output
    is ``N·V`` elements, of which ``Σ_j numel_j`` are updates.

    Args:
        updates: the update of every item this rank owns (``plan.names_of(rank)``),
            any memory layout.
        plan: the owner plan, over ``group``.
        group: the process group; default the world.
        out: optional destinations the gathered updates are copied into on
            ``wait()`` (names not in ``out`` stay in the receive buffer).
        stats: where to record bytes; default :func:`~dmuon.comm.default_stats`.
        verify: agree across ranks on valid, matching inputs first (see
            :func:`~dmuon.comm.reduce_to_owners`).
        device: where the send and receive buffers live. Default: the device of the
            updates, else of ``out``. Pass it where this rank may own nothing of the
            plan and gets no ``out``: the buffers must be on the device every other
            rank's are (NCCL refuses CPU tensors).

    Returns:
        A handle whose ``wait()`` gives ``{name: update}`` for every item (views
        into the receive buffer).

    Raises:
        ValueError: a group that does not match the plan, a missing update, or an
            update or ``out`` tensor whose shape or dtype differs from its item.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners, all_gather_updates
        >>> plan = plan_owners([MatrixItem("a", (2, 2)), MatrixItem("b", (1, 3))], 1)
        >>> got = all_gather_updates({"a": torch.ones(2, 2), "b": torch.zeros(1, 3)}, plan).wait()
        >>> sorted(got), got["a"].sum().item()
        (['a', 'b'], 4.0)
    """
    name = "all_gather_updates"

    def check() -> tuple[int, int]:
        n = group_size(group)
        if n != plan.world_size:
            raise ValueError(
                f"{name}: the process group has {n} ranks but the plan was made for "
                f"world_size={plan.world_size}"
            )
        me = group_rank(group)
        check_owned(name, plan, me, updates, noun="update", missing="gave no update for it")
        for key, t in (out or {}).items():
            if key not in plan or tuple(t.shape) != plan.item(key).shape:
                raise ValueError(
                    f"{name}: out[{key!r}] must be an item of the plan with its shape, got "
                    f"shape {tuple(t.shape)}"
                )
        return n, me

    n, me, stats = begin(name, plan, group, check, verify=verify, stats=stats)
    works, received = [], []
    device = buffer_device(device, updates, out)
    for dtype, per_rank in items_by_dtype(plan, n):
        volume = max(sum(i.numel for i in its) for its in per_rank)
        if volume == 0:  # only empty items (the empty shards of an uneven split): no send
            received.append((torch.empty(0, dtype=dtype, device=device), per_rank, 0))
            continue
        send = torch.zeros(volume, dtype=dtype, device=device)
        offset = 0
        for item in per_rank[me]:
            send[offset : offset + item.numel].view(item.shape).copy_(updates[item.name])
            offset += item.numel
        recv = torch.empty(n * volume, dtype=dtype, device=device)
        if n > 1:
            works.append(all_gather_single(recv, send, group=group, async_op=True))
            stats.record_collective(name, "all_gather", nbytes=send.nbytes, world_size=n)
        else:
            recv.copy_(send)
        received.append((recv, per_rank, volume))

    def finish() -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = {}
        for recv, per_rank, volume in received:
            for r, its in enumerate(per_rank):
                offset = r * volume
                for item in its:
                    result[item.name] = recv[offset : offset + item.numel].view(item.shape)
                    offset += item.numel
        with torch.no_grad():  # `out` may hold a model's Parameters (leaves needing grad)
            for key, t in (out or {}).items():
                t.copy_(result[key])
        return result

    return CommHandle(works, finish, what="all-gather of updated matrices", group=group)
