"""Gradient presence agreed over the tensor-parallel groups before their first collective.

A DTensor parameter held over a tensor-parallel group (a matrix split over ``tp``, a
matrix or a norm weight replicated over it) is stepped by the group together: a split
matrix's Gram all-reduces, a pending sum's (``Partial``) all-reduce or reduce-scatter,
or, for a replicated copy, the same update on every rank. DTensor's backward gives such a
parameter a gradient on every rank of its mesh or on none; a training loop that drops
one rank's (``p.grad = None`` on one ``tp`` rank, a hook that returns ``None`` there)
leaves the group's ranks in different collectives, and the step would end in a deadline
error that names two collectives but no parameter. :func:`agree_split_presence` counts,
with one small all-reduce per group, on how many ranks of the group each parameter has
a gradient, before the step's (or clipping's) first collective over the group, and
every rank of the group raises :class:`GradientPresenceError`, naming the parameters,
when some have one and some do not. Nothing is stepped and no state is changed.

Expert stacks split over their expert dimension are left out: each rank steps its own
experts, with no collective, and a rank whose experts saw no token may hold no gradient.
So are the mesh dimensions the mode plans owners over (``replicated`` mode's ``dp``): a
gradient missing on one of those ranks counts as zero (the engine's presence flags).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, wait_work
from dmuon.comm.flags import flag_device
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.placements import placement_of_param

__all__ = ["GradientPresenceError", "agree_split_presence", "presence_groups"]

STATS_NAME = "split_presence_flags"
"""The name under which the engine's stats count the presence all-reduces."""

PresenceGroups = list[tuple[dist.ProcessGroup, list[EngineParam]]]


class GradientPresenceError(RuntimeError):
    """A DTensor parameter has a gradient on some ranks of its tensor-parallel group and
    none on others (raised on every rank of the group, before its first collective).

    Attributes:
        names: the parameters at fault, as errors name them.
        ranks: the group's global ranks.

    Examples:
        >>> err = GradientPresenceError("fc1.weight: 1 of 2 ranks", ["fc1.weight"], [0, 1])
        >>> isinstance(err, RuntimeError), err.names
        (True, ['fc1.weight'])
    """

    def __init__(self, message: str, names: list[str], ranks: list[int]) -> None:
        super().__init__(message)
        self.names = names
        self.ranks = ranks


def presence_groups(
    params: Iterable[EngineParam], planning: Iterable[dist.ProcessGroup | None] = ()
) -> PresenceGroups:
    """The groups whose ranks must agree on the gradient presence of some of ``params``,
    each with those parameters (in ``params``' order, the same on every rank).

    A DTensor parameter counts over every mesh dimension of more than one rank, except
    expert stacks (:attr:`~dmuon.optim.engine.placements.MatrixPlacement.expert_split`,
    :attr:`~dmuon.optim.engine.placements.MatrixPlacement.whole_experts`) and the
    dimensions whose group has the ranks of one of ``planning`` (the groups a mode plans
    owners over, where a missing gradient is a zero). Called at ``bind``, on every rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    skip = {_ranks(g) for g in planning}
    found: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[EngineParam]]] = {}
    for e in params:
        if not is_dtensor(e.param):
            continue
        if e.matrix:
            pl = placement_of_param(e)
            if pl.expert_split or pl.whole_experts:
                continue
        mesh = e.param.device_mesh  # type: ignore[attr-defined]
        for d in range(mesh.ndim):
            if mesh.size(d) == 1:
                continue
            group = mesh.get_group(d)
            ranks = _ranks(group)
            if ranks in skip:
                continue
            found.setdefault(ranks, (group, []))[1].append(e)
    return [found[k] for k in sorted(found)]


def agree_split_presence(groups: PresenceGroups, stats: CommStats | None = None) -> None:
    """Count, over each group of :func:`presence_groups`, the ranks holding a gradient of
    each of its parameters (one ``int32`` all-reduce per group, waited under DMuon's
    deadline, counted in ``stats`` under :data:`STATS_NAME`), and raise where a count is
    neither zero nor the group's size.

    Raises:
        GradientPresenceError: on every rank of the group, naming the parameters with a
            gradient on some of its ranks only, and whether this rank holds one.
    """
    for group, params in groups:
        here = [e.param.grad is not None for e in params]
        counts = torch.tensor(here, dtype=torch.int32, device=flag_device(group))
        size = dist.get_world_size(group)
        wait_work(
            dist.all_reduce(counts, group=group, async_op=True),
            "all-reduce of the gradient-presence flags of tensor-parallel parameters",
            group,
        )
        if stats is not None:
            stats.record_collective(STATS_NAME, "all_reduce", nbytes=counts.nbytes, world_size=size)
        _check(params, here, counts.tolist(), size, group)


def _check(
    params: Sequence[EngineParam],
    here: Sequence[bool],
    counts: Sequence[int],
    size: int,
    group: dist.ProcessGroup,
) -> None:
    bad = [i for i, n in enumerate(counts) if 0 < n < size]
    if not bad:
        return
    ranks = list(_ranks(group))
    names = [params[i].name for i in bad]
    listed = ", ".join(
        f"{params[i].name!r} (on {counts[i]} of {size} ranks; "
        f"{'present' if here[i] else 'missing'} on this rank)"
        for i in bad[:5]
    )
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise GradientPresenceError(
        f"a gradient is missing on some ranks of tensor-parallel group {ranks} and present "
        f"on others: {listed}{more}. The group steps these parameters together (their "
        "shards, or the same copy on every rank), so every rank of it must hold their "
        "gradients or none must; DTensor's backward gives them on every rank. Do not set "
        "p.grad = None (or drop a gradient in a hook) on some ranks only. Nothing was "
        "stepped on this group's ranks",
        names,
        ranks,
    )


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
