"""Process-group checks shared by the wrappers, and the cross-rank agreement step.

A wrapper that rejects its input on one rank only would leave the other ranks
waiting in a collective that never completes. Every wrapper therefore validates
what all ranks can see alike (the plan, the group sizes, the layouts built from
the plan) before it issues anything, and, with ``verify=True``, first exchanges a
small fingerprint and an ok-flag with every rank of the group, so that an input
that only one rank rejects (or a rank that calls with a different plan or
layout) raises :class:`CollectiveInputError` on *every* rank instead of hanging.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.flags import flag_device
from dmuon.comm.objects import all_gather_objects
from dmuon.comm.torch_compat import all_gather_single

__all__ = [
    "CollectiveInputError",
    "agree",
    "check_launched",
    "check_member",
    "group_rank",
    "group_size",
    "twin_groups",
    "twin_slot",
]

T = TypeVar("T")


class CollectiveInputError(ValueError):
    """Ranks disagreed on a collective's inputs; raised on every rank, before any transfer.

    Attributes:
        op: the wrapper that was called.
        messages: global rank → the error that rank found in its own input.
        mismatched: global ranks whose plan or layout fingerprint differs from the
            one most ranks share.

    Examples:
        >>> err = CollectiveInputError("reduce_to_owners", {1: "ValueError: bad shape"}, [])
        >>> err.bad_ranks
        [1]
    """

    def __init__(self, op: str, messages: dict[int, str], mismatched: list[int]):
        self.op = op
        self.messages = dict(sorted(messages.items()))
        self.mismatched = sorted(mismatched)
        lines = [f"{op}: the ranks' inputs do not go together, so no rank started it:"]
        for rank, msg in self.messages.items():
            lines.append(f"  rank {rank}: {msg}")
        if self.mismatched:
            lines.append(
                f"  ranks {self.mismatched} call it with a different plan, layout or "
                "arguments than the other ranks"
            )
        super().__init__("\n".join(lines))

    @property
    def bad_ranks(self) -> list[int]:
        """Global ranks that rejected their own input."""
        return list(self.messages)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; 1 when torch.distributed is not initialised and no group is given."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        return 1
    return dist.get_world_size(group)


def check_launched(what: str) -> None:
    """Refuse to go on alone in a process a launcher started as one of several.

    ``torchrun`` (and every launcher built on torch's elastic agent, DeepSpeed's,
    ``accelerate launch``) sets ``WORLD_SIZE`` for each process it starts. A process that
    reads ``WORLD_SIZE`` > 1 but has not called ``torch.distributed.init_process_group``
    sees no process group: a world of one, in which every process would plan, step and
    train alone without an error. Called where such a slip would be silent.

    Args:
        what: the call that needs the process group, named in the error
            (``"dedicate()"``).

    Raises:
        RuntimeError: ``WORLD_SIZE`` > 1 and torch.distributed is not initialised.

    Examples:
        >>> check_launched("DMuon(...)")  # WORLD_SIZE unset here: nothing to say
    """
    launched = os.environ.get("WORLD_SIZE", "1").strip()
    if not launched.isdigit() or int(launched) <= 1:
        return
    if dist.is_available() and dist.is_initialized():
        return
    raise RuntimeError(
        f"{what}: WORLD_SIZE={launched} says this process is one of {launched} (torchrun or "
        "another launcher started it), but torch.distributed is not initialised, so every "
        f"process would train alone. Call torch.distributed.init_process_group() on every rank "
        f"before {what}"
    )


def check_member(group: object, what: str) -> None:
    """Raise if ``group`` is what ``torch.distributed.new_group`` gives a rank outside it.

    torch hands a non-member the int ``GroupMember.NON_GROUP_MEMBER`` instead of a group;
    passed on, it failed later as "a ProcessGroup or None, got int", or was taken by a
    mode that reads no group.

    Raises:
        ValueError: naming ``what`` and this rank.

    Examples:
        >>> check_member(None, "process_group")  # the world: every rank is a member
    """
    member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    if member is not None and not isinstance(group, dist.ProcessGroup) and group == member:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(
            f"{what}: this rank (global rank {rank}) is not a member of the process group "
            "it was given (torch.distributed.new_group gives a rank outside the group "
            "GroupMember.NON_GROUP_MEMBER); call it only on the group's ranks, or pass a "
            "group this rank is in"
        )


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group it was given")
    return rank


# (ranks, purpose, slot) → the twin made for them: one per process, reused
_TWINS: dict[tuple[tuple[int, ...], str, int], dist.ProcessGroup] = {}


def twin_groups(
    groups: Sequence[dist.ProcessGroup | None], *, purpose: str = "agreement", slot: int = 0
) -> list[dist.ProcessGroup | None]:
    """A twin of each group: the same ranks, a communicator of its own.

    For a check that must not be matched with a collective another library issues on
    the same group (a rank that skipped the check is then in DDP's, FSDP2's or tensor
    parallelism's next collective). Every rank calls this at construction, for its own
    groups: the twin of a group of every rank is made by all of them
    (``dist.new_group``), a subgroup's by its members only
    (``use_local_synchronization``), after they agree on the name torch gives it
    (:func:`_align_group_names`).

    A twin is created once per process for each set of ranks, ``purpose`` and ``slot``
    and reused by every later call (every optimizer and every ``dedicate()`` of the
    process): ``torch.distributed`` never frees a group nobody destroys, so a twin
    per call would leak a communicator (and its sockets or NCCL memory) with each
    optimizer built, or refused. Uses whose collectives could meet in a different
    order on different ranks take different ``purpose`` values, so they never share a
    communicator: ``"agreement"`` (the step's guards), ``"presence"`` (owner mode's
    gradient-presence flags), ``"use"`` (the partial-use check at the end of a
    forward), ``"reduce"`` (owner mode's reductions and broadcasts, away from FSDP2's
    own), ``"publish"`` (ZeRO-3-like broadcasts, away from the reductions). Two users
    of one purpose issue their collectives in program order, as every rank does —
    except where the order depends on the data: a dedication launches a layer's
    reduction in backward on a rank that used the layer and holds it to the step on
    one that did not, so two live dedications over the same ranks take different
    ``slot`` values (``dedicate()`` picks the lowest one no live dedication holds on
    any rank). After ``destroy_process_group()`` and a new ``init_process_group()`` the
    twins are made anew. Every member must ask for the same twins in the same order (as
    for any ``new_group``): a twin is made on the first call for its ranks, purpose and
    slot.

    Args:
        groups: the groups (``None``: the world).
        purpose: what the twin is for (keyword).
        slot: which of the twins of ``purpose`` (keyword; ``0`` by default).

    Raises:
        ValueError: ``purpose`` empty or not a ``str``; ``slot`` not an int ``>= 0``.
    """
    if not isinstance(purpose, str) or not purpose:
        raise ValueError(f"twin_groups: purpose must be a non-empty str, got {purpose!r}")
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise ValueError(f"twin_groups: slot must be an int >= 0, got {slot!r}")
    twins: list[dist.ProcessGroup | None] = []
    for g in groups:
        ranks = tuple(dist.get_process_group_ranks(dist.group.WORLD if g is None else g))
        key = (ranks, purpose, slot)
        twin = _TWINS.get(key)
        if twin is None or not _alive(twin):
            twin = _new_twin(ranks, g)
            _TWINS[key] = twin
        twins.append(twin)
    return twins


def twin_slot(group: dist.ProcessGroup | None) -> int:
    """The ``slot`` :func:`twin_groups` made ``group`` for (``0`` for a group that is no
    twin): a dedication's other twins (its ZeRO-3-like broadcasts') take its reduction
    twin's slot."""
    for (_, _, slot), twin in _TWINS.items():
        if twin is group:
            return slot
    return 0


def _new_twin(ranks: tuple[int, ...], parent: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new group of ``ranks``, made by the ranks that call this: all of the world's
    (a plain ``new_group``, named by torch's counter, which every rank advances alike),
    or a subgroup's members (``use_local_synchronization``)."""
    if len(ranks) == dist.get_world_size():
        return dist.new_group(list(ranks))
    _align_group_names(parent)
    return dist.new_group(list(ranks), use_local_synchronization=True)


def _align_group_names(group: dist.ProcessGroup | None) -> None:
    """Make every member of ``group`` hold as many process groups as the one holding most.

    torch names a group made with ``use_local_synchronization`` by a hash of its ranks
    and of how many groups this process holds (``distributed_c10d._hash_ranks_to_str``,
    torch 2.x), and its members meet in the store under that name. A rank holds only
    the groups it is a member of, so after an unrelated ``new_group([0, 1])`` on four
    ranks, ranks 0–1 hold one more than ranks 2–3: the twin of a group of ranks 0 and 2
    had two names and its members waited for each other until the process group's
    timeout. The counts are all-gathered over ``group`` (under the current deadline),
    and a rank holding fewer makes groups of itself alone until they are equal (a group
    of one rank meets nobody). torch keeps the count in a private attribute; where it
    is absent (another torch), nothing is done."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if names is None or group_size(group) < 2:
        return
    device = flag_device(group)
    mine = torch.tensor([len(names)], dtype=torch.int64, device=device)
    counts = torch.empty(group_size(group), dtype=torch.int64, device=device)
    work = all_gather_single(counts, mine, group=group, async_op=True)
    wait_work(work, "all-gather of the process-group counts (naming DMuon's twin group)", group)
    for _ in range(int(counts.max()) - len(names)):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (neither it nor its world destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def fingerprint(*parts: object) -> int:
    """A 62-bit hash of ``repr(parts)`` (fits an int64 tensor)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def agree(
    op: str,
    groups: Sequence[dist.ProcessGroup | None],
    check: Callable[[], T],
    fingerprint_value: int,
) -> T:
    """Run ``check`` (local validation) and make every rank of ``groups`` agree.

    For each group in turn, every rank contributes ``[bad, fingerprint]`` to one small
    all-gather, where ``bad`` already includes what earlier groups reported; with the
    shard and replicate groups of an HSDP mesh this reaches every rank. If any rank's
    ``check`` raised or the fingerprints differ, every rank raises
    :class:`CollectiveInputError` (each rank's message is exchanged in a second step
    that only runs on this error path). Otherwise returns ``check()``'s value.
    """
    local: Exception | None = None
    value: T | None = None
    try:
        value = check()
    except Exception as exc:  # any local failure must reach the other ranks
        local = exc
    active = [g for g in groups if group_size(g) > 1]
    if not active:
        if local is not None:
            raise local
        return value  # type: ignore[return-value]
    bad = local is not None
    mismatched: set[int] = set()
    for g in active:
        n = dist.get_world_size(g)
        device = flag_device(g)
        mine = torch.tensor([int(bad), fingerprint_value], dtype=torch.int64, device=device)
        everyone = torch.empty(2 * n, dtype=torch.int64, device=device)
        work = all_gather_single(everyone, mine, group=g, async_op=True)
        wait_work(work, f"all-gather of the {op!r} check's flags", g)
        flags, prints = everyone[0::2].tolist(), everyone[1::2].tolist()
        ranks = dist.get_process_group_ranks(g) if g is not None else list(range(n))
        # The odd ones out differ from the most common fingerprint (ties: the lowest rank's).
        common = max(set(prints), key=lambda p: (prints.count(p), -prints.index(p)))
        mismatched |= {ranks[r] for r in range(n) if prints[r] != common}
        bad = bad or any(flags) or bool(mismatched)
    if not bad:
        return value  # type: ignore[return-value]
    text = "" if local is None else f"{type(local).__name__}: {local}"
    messages = {dist.get_rank(): text} if text else {}
    known = (messages, sorted(mismatched))
    for g in active:
        gathered = all_gather_objects(known, group=g)
        merged: dict[int, str] = {}
        mism: set[int] = set()
        for entry in gathered:
            msgs, mm = cast(tuple[dict[int, str], list[int]], entry)
            merged.update(msgs)
            mism |= set(mm)
        known = (merged, sorted(mism))
    error = CollectiveInputError(op, known[0], known[1])
    if local is not None:
        raise error from local
    raise error
