"""Expert stacks split over an expert-parallel mesh dimension: the group each is split over.

An expert stack ``(E, m, n)`` (group key ``flatten=False``) with ``Shard(0)`` over one
mesh dimension (``ep``) and ``Replicate()`` over the others
(:attr:`~dmuon.optim.engine.placements.MatrixPlacement.expert_split`) is held as whole
experts: rank ``r`` of the ``ep`` group holds its block of ``E``. No collective is needed
to step them; what the modes need to know is which ranks hold *other* experts (the
``ep`` group: a skipped step and the gradient norm must agree over it) and which hold
*the same* ones (the other mesh dimensions: the data-parallel replicas).

``single`` mode steps every rank's experts where they are. ``replicated`` mode plans
owners over its data-parallel group, which must cross the ``ep`` group in this rank
alone (a ``dp × ep`` mesh, ``process_group`` the ``dp`` group; checked with the
tensor-parallel splits by :func:`~dmuon.optim.engine.tensor_split.check_split_groups`):
each stack has one owner among its replicas, which steps its experts as a batch, and
the all-gather over ``dp`` gives the other replicas the new experts — the Newton–Schulz
work of the experts divided by the data-parallel degree instead of repeated on every
replica.

Owner mode (``ddp.dedicate``) steps the stacks whose mesh spans exactly the ranks it plans
on (:func:`in_place_replicas`) where they live: a 1-D ``ep`` mesh over them (no replicas),
or a ``dp × ep`` mesh over them, where each stack has one owner among its ``dp`` replicas
(:func:`replica_owners`; :mod:`~dmuon.optim.engine.expert_replicas` reduces the gradient
to it and broadcasts the stepped experts back).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from dmuon.comm import MatrixItem, plan_owners
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.placements import placement_of_param

__all__ = ["expert_group_of", "expert_groups", "in_place_replicas", "replica_owners"]


def expert_group_of(e: EngineParam) -> tuple[int, dist.ProcessGroup] | None:
    """The mesh dimension and process group the expert stack ``e`` is split over along its
    expert dimension, or ``None`` when ``e`` is not such a stack (a plain tensor, a 2-D
    matrix, another layout)."""
    if not e.matrix or not is_dtensor(e.param):
        return None
    pl = placement_of_param(e)
    if not pl.expert_split:
        return None
    mesh_dim = pl.shards[0][0]
    return mesh_dim, e.param.device_mesh.get_group(mesh_dim)  # type: ignore[attr-defined]


def expert_groups(params: Iterable[EngineParam]) -> list[dist.ProcessGroup]:
    """The distinct process groups the expert stacks among ``params`` are split over, in
    the order of their ranks (the same list on every rank of a group)."""
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for e in params:
        split = expert_group_of(e)
        if split is not None:
            found.setdefault(tuple(dist.get_process_group_ranks(split[1])), split[1])
    return [found[k] for k in sorted(found)]


def in_place_replicas(
    p: Any, mesh_dim: int, planning: Iterable[int]
) -> list[dist.ProcessGroup] | None:
    """For an expert stack ``p`` split along its expert dimension over mesh dimension
    ``mesh_dim``: the groups of its other mesh dimensions with more than one rank (the
    ranks holding the same experts, whose gradients add up to the stack's) when its
    mesh spans exactly the ranks ``planning``; ``None`` when it does not (its mesh reaches
    ranks outside ``planning``, or covers only some of them).

    A 1-D ``ep`` mesh over ``planning`` gives ``[]``; a ``dp × ep`` mesh over it gives the
    ``dp`` group of this rank.
    """
    mesh = p.device_mesh
    if sorted(int(r) for r in mesh.mesh.flatten().tolist()) != sorted(planning):
        return None
    return [mesh.get_group(d) for d in range(mesh.ndim) if d != mesh_dim and mesh.size(d) > 1]


def replica_owners(items: Sequence[MatrixItem], replicas: int) -> dict[str, int]:
    """The owner of each expert stack among the ``replicas`` ranks holding the same experts,
    by its index in their sorted ranks: :func:`~dmuon.comm.plan_owners` of the stacks as
    each replica holds them (``items``: name, local shape ``(E_local, m, n)``, dtype), each
    stack whole, without layers. A pure function of the items, so every replica, and
    ``ddp.dedicate`` planning the dense matrices around each rank's share, get the same.

    Examples:
        >>> from dmuon.comm import MatrixItem
        >>> stacks = [MatrixItem(n, (2, 8, 6)) for n in ("a.w_in", "a.w_out", "b.w_in")]
        >>> owners = replica_owners(stacks, 2)
        >>> sorted(owners), sorted(owners.values())
        (['a.w_in', 'a.w_out', 'b.w_in'], [0, 0, 1])
    """
    if replicas == 1:
        return {i.name: 0 for i in items}
    plain = [MatrixItem(i.name, i.shape, i.dtype) for i in items]
    plan = plan_owners(plain, replicas, pack_below=0, spread_layers=False)
    return dict(zip(plan.names, plan.owners, strict=True))
