"""Expert stacks held by several ranks in owner mode: one owner among the replicas.

On a ``dp × ep`` mesh each rank's experts (its block of every stack split over ``ep``)
are also held by its ``dp`` replicas. Owner mode (``ddp.dedicate``) gives each stack one
owner among them (:func:`~dmuon.optim.engine.expert_split.replica_owners`) — the owner
idea of DMuon (Chen et al., 2026) applied within each replica set, as ``replicated``
mode does for the experts:

1. :meth:`ExpertReplicas.reduce` sums each stack's gradient into its owner: one
   ``reduce`` over ``dp`` per owner and dtype, every stack of that owner in one flat
   buffer (a replica without a gradient sends zeros);
2. the owner steps its stacks (the others hold placeholder state);
3. :meth:`ExpertReplicas.start_broadcast` sends the stepped experts back: one
   ``broadcast`` per owner and dtype, waited by :meth:`ExpertReplicas.wait_broadcast` at
   the end of the step, after the dense layers.

Over a replica set of ``R`` ranks that is ``2 (R − 1)/R`` of the experts' bytes per rank,
as one all-reduce, while each stack is orthogonalised once instead of ``R`` times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, MatrixItem
from dmuon.comm.faults import wait_work
from dmuon.optim.engine.expert_split import replica_owners
from dmuon.optim.engine.params import EngineParam
from dmuon.optim.matrix_split import local_tensor

__all__ = ["EXPERT_REPLICAS_STATS_NAME", "ExpertReplicas"]

EXPERT_REPLICAS_STATS_NAME = "expert_replicas"
"""The ``CommStats`` name of the experts' reduce to their owner among the replicas and of
the broadcast back."""


class _ReplicaSet:
    """One group of ranks holding the same experts and the stacks they share."""

    def __init__(self, group: dist.ProcessGroup, params: Sequence[EngineParam]) -> None:
        self.group = group
        self.ranks = sorted(dist.get_process_group_ranks(group))
        items = [
            MatrixItem(e.name, tuple(local_tensor(e.param).shape), e.param.dtype) for e in params
        ]
        owners = replica_owners(items, len(self.ranks))
        self.owner = {id(e.param): owners[e.name] for e in params}
        me = self.ranks.index(dist.get_rank())
        self.mine = {id(e.param) for e in params if owners[e.name] == me}
        # per (owner index, dtype), the stacks in one flat buffer, in a fixed order
        self.runs: dict[tuple[int, torch.dtype], list[EngineParam]] = {}
        for e in sorted(params, key=lambda e: e.name):
            self.runs.setdefault((owners[e.name], e.param.dtype), []).append(e)


class ExpertReplicas:
    """The replica sets of owner mode's in-place expert stacks (see the module docstring).

    Args:
        groups: per group of ranks holding the same experts (``dp`` of a ``dp × ep``
            mesh), the stacks they share.
        stats: where the collectives are counted (:data:`EXPERT_REPLICAS_STATS_NAME`).
    """

    def __init__(
        self,
        groups: Sequence[tuple[dist.ProcessGroup, Sequence[EngineParam]]],
        stats: CommStats,
    ) -> None:
        self.sets = [_ReplicaSet(g, params) for g, params in groups]
        self.stats = stats
        self._by_param = {pid: s for s in self.sets for pid in s.owner}
        self._pending: list[tuple[Any, torch.Tensor, list[EngineParam], _ReplicaSet]] = []

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self._by_param

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank is the owner of ``p`` among its replicas."""
        s = self._by_param.get(id(p))
        return s is not None and id(p) in s.mine

    def owner_of(self, p: torch.Tensor) -> tuple[int, dist.ProcessGroup] | None:
        """``(owner's rank in the group, group)`` of a replicated stack, else ``None``."""
        s = self._by_param.get(id(p))
        if s is None:
            return None
        return dist.get_group_rank(s.group, s.ranks[s.owner[id(p)]]), s.group

    def _flat(self, members: list[EngineParam], grads: bool) -> torch.Tensor:
        parts = []
        for e in members:
            local = local_tensor(e.param)
            g = e.param.grad if grads else e.param
            parts.append(
                (local_tensor(g) if g is not None else torch.zeros_like(local)).reshape(-1)
            )
        return torch.cat(parts)

    def _count(self, op: str, flat: torch.Tensor, s: _ReplicaSet) -> None:
        nbytes = flat.numel() * flat.element_size()
        self.stats.record_collective(
            EXPERT_REPLICAS_STATS_NAME, op, nbytes=nbytes, world_size=len(s.ranks)
        )

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum every replicated stack's gradient into its owner (launched together, waited
        under the step's deadline); the owner's gradient becomes the sum."""
        from torch.distributed.tensor import DTensor

        works = []
        for s in self.sets:
            for (owner, _), members in s.runs.items():
                flat = self._flat(members, grads=True)
                self._count("reduce", flat, s)
                work = dist.reduce(flat, dst=s.ranks[owner], group=s.group, async_op=True)
                works.append((work, flat, members, s, owner))
        me = dist.get_rank()
        for work, flat, members, s, owner in works:
            wait_work(work, "reduce of the experts' gradients to their owner (owner mode)", s.group)
            if s.ranks[owner] != me:
                continue
            offset = 0
            for e in members:
                local = local_tensor(e.param)
                part = flat[offset : offset + local.numel()].view_as(local)
                offset += local.numel()
                if e.param.grad is not None:
                    local_tensor(e.param.grad).copy_(part)
                else:
                    p: Any = e.param
                    p.grad = DTensor.from_local(
                        part.clone(), p.device_mesh, p.placements, run_check=False
                    )

    @torch.no_grad()
    def start_broadcast(self) -> None:
        """Send each owner's stepped experts to its replicas (waited by
        :meth:`wait_broadcast`)."""
        for s in self.sets:
            for (owner, _), members in s.runs.items():
                flat = self._flat(members, grads=False)
                self._count("broadcast", flat, s)
                work = dist.broadcast(flat, src=s.ranks[owner], group=s.group, async_op=True)
                self._pending.append((work, flat, members, s))

    @torch.no_grad()
    def wait_broadcast(self) -> None:
        """Wait for :meth:`start_broadcast`'s collectives; the replicas take the experts."""
        pending, self._pending = self._pending, []
        for work, flat, members, s in pending:
            wait_work(
                work, "broadcast of the stepped experts from their owner (owner mode)", s.group
            )
            offset = 0
            for e in members:
                local = local_tensor(e.param)
                part = flat[offset : offset + local.numel()]
                offset += local.numel()
                if id(e.param) not in s.mine:  # the owner sent its own
                    local.copy_(part.view_as(local))
