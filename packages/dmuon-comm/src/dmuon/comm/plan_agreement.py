"""Check that every rank computed the same owner plan, without risking a hang."""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.flags import flag_device
from dmuon.comm.owner_plan import OwnerPlan
from dmuon.comm.process_groups import group_size
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["PlanMismatchError", "check_plan_consistency"]


class PlanMismatchError(RuntimeError):
    """The ranks of a group hold different owner plans (raised on every rank).

    Attributes:
        digests: global rank → that rank's :meth:`~dmuon.comm.OwnerPlan.digest` prefix.

    Examples:
        >>> PlanMismatchError("plans differ", {0: "ab12", 1: "cd34"}).digests[1]
        'cd34'
    """

    def __init__(self, message: str, digests: dict[int, str]):
        super().__init__(message)
        self.digests = digests


def _hash62(payload: object) -> int:
    text = json.dumps(payload, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def check_plan_consistency(plan: OwnerPlan, group: dist.ProcessGroup | None = None) -> str:
    """Compare ``plan`` across the ranks of ``group``; raise on every rank if they differ.

    Every rank contributes a fingerprint of its plan (world and replicate sizes,
    item count, a hash of the items, a hash of the owners, the full digest) to one
    all-gather of eight int64 per rank, so every rank sees every fingerprint and
    all of them raise the same :class:`PlanMismatchError` — naming the ranks, and
    whether the items or only the owners differ — instead of some ranks going on
    into collectives the others never join. Ranks must all call it (with whatever
    plan they have). It also fails, on every rank, if any rank's plan was made for
    a different number of ranks than the group has. Call it once after planning.

    Args:
        plan: this rank's plan.
        group: the group whose ranks must agree (for HSDP: all ``R·S`` ranks);
            default the world.

    Returns:
        The plan's :meth:`~dmuon.comm.OwnerPlan.digest` (the same on every rank).

    Raises:
        PlanMismatchError: the plans differ, or a plan's world size is not the
            group's size.

    Examples:
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> plan = plan_owners([MatrixItem("w", (8, 8))], 1)
        >>> check_plan_consistency(plan) == plan.digest()  # one process: nothing to compare
        True
    """
    digest = plan.digest()
    n = group_size(group)
    items_hash = _hash62([[i.name, list(i.shape), str(i.dtype), i.layer] for i in plan.items])
    owners_hash = _hash62(list(plan.owners))
    full = int(digest[:15], 16)
    mine = [plan.world_size, plan.replicate_size, len(plan.items), items_hash, owners_hash, full]
    if n == 1:
        rows = [mine]
        ranks = [dist.get_rank() if dist.is_initialized() else 0]
    else:
        width = len(mine)
        device = flag_device(group)
        gathered = torch.empty(n * width, dtype=torch.int64, device=device)
        work = all_gather_single(
            gathered,
            torch.tensor(mine, dtype=torch.int64, device=device),
            group=group,
            async_op=True,
        )
        wait_work(work, "all-gather of the owner plan's digest", group)
        rows = [gathered[r * width : (r + 1) * width].tolist() for r in range(n)]
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    wrong_size = [ranks[r] for r, row in enumerate(rows) if row[0] != n]
    distinct = sorted(
        {tuple(row) for row in rows}, key=lambda row: [tuple(r) for r in rows].index(row)
    )
    if len(distinct) == 1 and not wrong_size:
        return digest
    digests = {ranks[r]: f"{row[5]:015x}" for r, row in enumerate(rows)}
    lines = ["owner plans differ across ranks, so their collectives would not match:"]
    for k, row in enumerate(distinct):
        holders = [ranks[r] for r, other in enumerate(rows) if tuple(other) == row]
        lines.append(
            f"  plan {chr(65 + k) if k < 26 else k}: ranks {holders}: world_size={row[0]}, "
            f"replicate_size={row[1]}, {row[2]} items, digest {row[5]:015x}…"
        )
    if wrong_size:
        lines.append(
            f"  ranks {wrong_size} hold a plan for a world size other than the group's {n}"
        )
    if len(distinct) > 1:
        if len({row[3] for row in distinct}) > 1:
            what = "the items differ (names, shapes, dtypes or layers)"
        elif len({row[0:3] for row in map(tuple, distinct)}) > 1:
            what = "the world or replicate sizes differ"
        else:
            what = "the items agree but the owners differ (strategy, cost or an ILP time limit)"
        lines.append(f"  {what}")
    lines.append(
        "  make every rank call plan_owners with the same items and arguments "
        "(or plan on one rank and broadcast the plan)"
    )
    raise PlanMismatchError("\n".join(lines), digests)
