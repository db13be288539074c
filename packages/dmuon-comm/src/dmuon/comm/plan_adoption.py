"""One owner plan on every rank, even when each rank's planner ran against a clock."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.flags import flag_device
from dmuon.comm.objects import broadcast_object
from dmuon.comm.owner_plan import OwnerPlan
from dmuon.comm.plan_agreement import _hash62
from dmuon.comm.process_groups import group_size
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["adopt_first_plan"]


def _fingerprint(plan: OwnerPlan) -> list[int]:
    """What must agree for a plan to be adopted (sizes, items), then the owners' digest."""
    items = _hash62([[i.name, list(i.shape), str(i.dtype), i.layer] for i in plan.items])
    return [
        plan.world_size,
        plan.replicate_size,
        len(plan.items),
        items,
        int(plan.digest()[:15], 16),
    ]


def adopt_first_plan(
    plan: OwnerPlan, groups: Sequence[dist.ProcessGroup | None] = (None,)
) -> OwnerPlan:
    """``plan``, or the plan of the first rank of each group where only the owners differ.

    :func:`~dmuon.comm.plan_owners` is a pure function of its arguments except for
    ``strategy="ilp"``: the solver runs under a wall-clock limit (``ilp_time_limit``),
    so ranks on one machine, slowed differently by the others, can stop at different
    incumbents and plan different owners for the same model. Their collectives would
    then not match. Here the ranks compare a fingerprint of their plans (one
    all-gather of five int64 per rank); when the plans agree — always, for every
    strategy but a time-limited ILP — nothing else travels. When they differ, the
    group's first rank (its rank 0) broadcasts its owners, units, loads and
    solver, and every rank whose world size, replicate size and items (names, shapes,
    dtypes, layers) equal that rank's takes them, keeping its own items. A rank whose
    items differ keeps its own plan, so that
    :func:`~dmuon.comm.check_plan_consistency` (or DMuon's model check), called next,
    still reports the different model as such.

    Any other cause of different owners over one model is settled the same way, on
    purpose: costs measured on each rank (a ``batch_cost`` or a mapping of timings that
    differ between ranks by noise), or plan arguments that differ between ranks (a
    ``strategy`` or ``pack_below`` read from a rank-local setting). The first rank's plan
    is then every rank's, so the collectives match; its arguments are the ones that count.

    Over several groups in turn (HSDP: the shard group, then the replicate group; a
    ``dp × tp`` mesh: ``dp``, then ``tp``) every rank ends with the plan of the rank
    that is first in all of them. Every rank of each group must call it, with whatever
    plan it has; the waits run under the current :func:`~dmuon.comm.collective_timeout`.

    Args:
        plan: this rank's plan.
        groups: the groups whose ranks must hold one plan, in order (``None``: the
            world). Groups of one rank are skipped.

    Returns:
        The plan this rank should use: ``plan`` itself, or one with ``plan``'s items
        and the first rank's owners.

    Examples:
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> plan = plan_owners([MatrixItem("w", (8, 8))], 1)
        >>> adopt_first_plan(plan) is plan  # one process: nothing to agree on
        True
    """
    for group in groups:
        if not (dist.is_available() and dist.is_initialized()) or group_size(group) == 1:
            continue
        plan = _adopt_over(plan, group)
    return plan


def _adopt_over(plan: OwnerPlan, group: dist.ProcessGroup | None) -> OwnerPlan:
    n = group_size(group)
    mine = _fingerprint(plan)
    width = len(mine)
    device = flag_device(group)
    gathered = torch.empty(n * width, dtype=torch.int64, device=device)
    work = all_gather_single(
        gathered, torch.tensor(mine, dtype=torch.int64, device=device), group=group, async_op=True
    )
    wait_work(work, "all-gather of the owner plans' fingerprints", group)
    rows = [gathered[r * width : (r + 1) * width].tolist() for r in range(n)]
    if all(row == rows[0] for row in rows):
        return plan  # the same plan everywhere (every rank sees the same rows: no one sends)
    first = broadcast_object(
        (plan.owners, plan.units, plan.loads, plan.strategy, plan.solver), group
    )
    if mine[:4] != rows[0][:4]:
        return plan  # another model (or world): the model check names what differs
    owners, units, loads, strategy, solver = first
    return OwnerPlan(
        plan.items, owners, units, loads, plan.world_size, plan.replicate_size, strategy, solver
    )
