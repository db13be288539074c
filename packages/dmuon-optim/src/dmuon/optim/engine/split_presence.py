"""Gradient presence agreed over the tensor-parallel groups before their first collective.

A DTensor parameter held over a tensor-parallel group (a matrix split over ``tp``, a
matrix or a norm weight replicated over it) is stepped by the group together: a split
matrix's Gram all-reduces, a pending sum's (``Partial``) all-reduce or reduce-scatter,
or, for a replicated copy, the same update on every rank. DTensor's backward gives such a
parameter a gradient on every rank of its mesh or on none; a training loop that drops
one rank's (``p.grad = None`` on one ``tp`` rank, a hook that returns ``None`` there)
leaves the group's ranks in different collectives, and the step would end in a deadline
error that names two collectives but no parameter. :func:`agree_split_presence` counts,
with one small all-reduce per group (every group's before any answer is read), on how
many ranks of the group each parameter has a gradient, before the step's (or
clipping's) first collective over the group, and returns the parameters some ranks
hold a gradient of and others do not. The engine leaves them out of its settling (no
collective of theirs is issued), and the step's agreement carries the refusal to every
rank of the job (:func:`~dmuon.optim.engine.guards.agree_step`), which raises
:class:`GradientPresenceError` everywhere, naming them where they are known. Nothing
is stepped and no state is changed.

Expert stacks split over their expert dimension are left out: each rank steps its own
experts, with no collective, and a rank whose experts saw no token may hold no gradient.
So are the mesh dimensions the mode plans owners over (``replicated`` mode's ``dp``): a
gradient missing on one of those ranks counts as zero (the engine's presence flags).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, wait_work
from dmuon.comm.flags import flag_device
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.placements import placement_of_param

__all__ = [
    "GradientPresenceError",
    "agree_split_presence",
    "presence_error",
    "presence_groups",
]

STATS_NAME = "split_presence_flags"
"""The name under which the engine's stats count the presence all-reduces."""

PresenceGroups = list[tuple[dist.ProcessGroup, list[EngineParam]]]


class GradientPresenceError(RuntimeError):
    """A DTensor parameter has a gradient on some ranks of its tensor-parallel group and
    none on others (raised on every rank, by the step's agreement).

    Attributes:
        names: the parameters at fault known on this rank (none on a rank outside the
            groups where a gradient is missing).
        ranks: the ranks that found a parameter at fault.

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


def agree_split_presence(groups: PresenceGroups, stats: CommStats | None = None) -> dict[str, str]:
    """Count, over each group of :func:`presence_groups`, the ranks holding a gradient of
    each of its parameters (one ``int32`` all-reduce per group, every group's issued and
    waited under DMuon's deadline before any is read, counted in ``stats`` under
    :data:`STATS_NAME`), and return each parameter whose count is neither zero nor the
    group's size: its name → its description as errors give it (``{}``: none)."""
    counted = []
    for group, params in groups:
        here = [e.param.grad is not None for e in params]
        counts = torch.tensor(here, dtype=torch.int32, device=flag_device(group))
        size = dist.get_world_size(group)
        work = dist.all_reduce(counts, group=group, async_op=True)
        if stats is not None:
            stats.record_collective(STATS_NAME, "all_reduce", nbytes=counts.nbytes, world_size=size)
        counted.append((group, params, here, counts, size, work))
    found: dict[str, str] = {}
    for group, params, here, counts, size, work in counted:
        what = "all-reduce of the gradient-presence flags of tensor-parallel parameters"
        wait_work(work, what, group)
        ranks = list(_ranks(group))
        for e, mine, n in zip(params, here, counts.tolist(), strict=True):
            if 0 < n < size:
                held = "present" if mine else "missing"
                found.setdefault(
                    e.name,
                    f"{e.name!r} (on {n} of {size} ranks of group {ranks}; {held} on this rank)",
                )
    return found


def presence_error(ranks: list[int], found: Mapping[str, str]) -> GradientPresenceError:
    """The error every rank raises when the step's agreement says a gradient is missing on
    some ranks of a tensor-parallel group (``ranks``: where it was found; ``found``: this
    rank's parameters at fault, name → description as :func:`agree_split_presence` gives
    them, empty on a rank outside those groups)."""
    described = list(found.values())
    listed = "; ".join(described[:5])
    listed += f" and {len(described) - 5} more" if len(described) > 5 else ""
    here = f": {listed}" if found else " (on other ranks' groups)"
    return GradientPresenceError(
        f"a gradient is missing on some ranks of a tensor-parallel group and present on "
        f"others, found by rank(s) {ranks}{here}. The group steps these parameters "
        "together (their shards, or the same copy on every rank), so every rank of it must "
        "hold their gradients or none must; DTensor's backward gives them on every rank. "
        "Do not set p.grad = None (or drop a gradient in a hook) on some ranks only. "
        "Nothing was stepped on any rank; zero_grad() and go on",
        list(found),
        ranks,
    )


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
