"""Owner-rooted collectives: reduce each gradient to its owner, broadcast the result back.

This is DMuon's owner-centric traffic (Chen et al., *Efficient Distributed Muon
Training with Near-Adam Overhead*, 2026): the gradient of a matrix is reduced to
its owner only (not all-reduced), the owner computes the update, and the new
value is broadcast. Over all owners that is ``2(N−1)/N · P`` bytes per rank, the
same as one ring all-reduce, while only one rank orthogonalises each matrix.
Collectives are coalesced per owner: one per :class:`~dmuon.comm.FlatBucket`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from dmuon.comm.averaging import DIVIDED_BEFORE_THE_SUM
from dmuon.comm.faults import wait_work
from dmuon.comm.flat_buffers import FlatBucket
from dmuon.comm.handles import CommHandle
from dmuon.comm.owner_plan import OwnerPlan
from dmuon.comm.process_groups import agree, fingerprint, group_rank, group_size
from dmuon.comm.stats import CommStats, default_stats

__all__ = ["broadcast_from_owners", "check_buckets", "reduce_to_owners"]


def _mesh(
    plan: OwnerPlan,
    group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    op: str,
) -> tuple[int, int, int]:
    """(S, R, this rank's slot i·S + j), after checking the groups against the plan."""
    S, R = plan.shard_size, plan.replicate_size
    n = group_size(group)
    if R == 1:
        if replicate_group is not None:
            raise ValueError(
                f"{op}: replicate_group was given but the plan has replicate_size=1; "
                "make the plan with plan_owners(..., replicate_size=R) for HSDP"
            )
        if n != plan.world_size:
            raise ValueError(
                f"{op}: the process group has {n} ranks but the plan was made for "
                f"world_size={plan.world_size}; plan for this group's size or pass the "
                "group the plan is for"
            )
        return S, R, group_rank(group)
    if replicate_group is None:
        raise ValueError(
            f"{op}: the plan is an HSDP plan ({R} × {S}, replicate × shard); pass the shard "
            "group as group= and the replicate group as replicate_group="
        )
    r = group_size(replicate_group)
    if n != S or r != R:
        raise ValueError(
            f"{op}: the plan is {R} × {S} (replicate × shard) but group has {n} ranks and "
            f"replicate_group has {r}"
        )
    return S, R, group_rank(replicate_group) * S + group_rank(group)


def check_buckets(plan: OwnerPlan, buckets: Sequence[FlatBucket]) -> None:
    """Check that ``buckets`` fit ``plan``: what the owner collectives check on every call.

    Each bucket is a :class:`~dmuon.comm.FlatBucket` whose owner is a rank of the
    plan; each of its tensors is an item of the plan, of the plan's shape, owned by
    the bucket's owner, and in no other bucket. A bucket's layout cannot change, so
    buckets checked once can be passed to :func:`reduce_to_owners` and
    :func:`broadcast_from_owners` with ``checked=True`` every step after.

    Raises:
        ValueError: the first mismatch, naming the tensor and what the plan says.

    Examples:
        >>> import torch
        >>> from dmuon.comm import FlatBucket, MatrixItem, check_buckets, plan_owners
        >>> plan = plan_owners([MatrixItem("w", (2, 2))], 1)
        >>> check_buckets(plan, [FlatBucket([("w", (2, 3))], dtype=torch.float32, owner=0)])
        Traceback (most recent call last):
        ...
        ValueError: check_buckets: bucket tensor 'w' has shape (2, 3) but the plan says (2, 2)
    """
    _check_buckets(plan, buckets, "check_buckets")


def _check_buckets(plan: OwnerPlan, buckets: Sequence[FlatBucket], op: str) -> None:
    seen: set[str] = set()
    for b in buckets:
        if not isinstance(b, FlatBucket):
            raise ValueError(f"{op}: buckets must be FlatBucket objects, got {type(b).__name__}")
        if not 0 <= b.owner < plan.world_size:
            raise ValueError(
                f"{op}: a bucket has owner {b.owner}, outside [0, {plan.world_size}); build "
                "buckets with make_buckets(plan)"
            )
        for slot in b.slots:
            if slot.name not in plan:
                raise ValueError(f"{op}: bucket tensor {slot.name!r} is not an item of the plan")
            if slot.name in seen:
                raise ValueError(f"{op}: {slot.name!r} is in more than one bucket")
            seen.add(slot.name)
            item = plan.item(slot.name)
            if slot.shape != item.shape:
                raise ValueError(
                    f"{op}: bucket tensor {slot.name!r} has shape {slot.shape} but the plan "
                    f"says {item.shape}"
                )
            if plan.owner(slot.name) != b.owner:
                raise ValueError(
                    f"{op}: {slot.name!r} is in the bucket of rank {b.owner} but the plan's "
                    f"owner is rank {plan.owner(slot.name)}"
                )


def _layouts(buckets: Sequence[FlatBucket]) -> tuple[object, ...]:
    return tuple((b.owner, str(b.dtype), b.layout()) for b in buckets)


def _reduce_op(op: object) -> bool:
    """True for an average, False for a sum."""
    if op in ("avg", dist.ReduceOp.AVG):
        return True
    if op in ("sum", dist.ReduceOp.SUM):
        return False
    raise ValueError(f"op must be 'avg' or 'sum' (or ReduceOp.AVG/SUM), got {op!r}")


def _device_of(buckets: Sequence[FlatBucket]) -> torch.device | None:
    """Where the owner collectives' results are used next: kernels on the buckets' device
    (the rule chain, the copy into the weights), never a host read, so a backend whose
    wait is a stream wait leaves the host running (:func:`dmuon.comm.faults.wait_work`)."""
    return buckets[0].buffer.device if buckets else None


def reduce_to_owners(
    buckets: Sequence[FlatBucket],
    plan: OwnerPlan,
    *,
    op: object = "avg",
    group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    verify: bool = False,
    checked: bool = False,
) -> CommHandle[dict[str, torch.Tensor]]:
    """Reduce every bucket to its owner: ``G_owner = (1/N) Σ_ranks G_rank`` (or the sum).

    One ``dist.reduce`` per bucket (so coalesced per owner when buckets come from
    :func:`~dmuon.comm.make_buckets`), all started at once. The average is a SUM
    followed by one division on the owner, in the bucket's floating dtype (gloo has
    no AVG for every dtype, and one scaling keeps the result identical across
    backends). With an HSDP plan the reduction has two stages: within the shard
    ``group`` to shard index ``j``, then within the ``replicate_group`` to replica
    ``i``; the second stage starts when the handle is waited on.

    After :meth:`~dmuon.comm.CommHandle.wait`, the owner's buckets hold the
    result; the contents of the other ranks' buckets are unspecified (reductions
    use them as scratch).

    Args:
        buckets: this rank's contribution for every item, in the same layouts on
            every rank (build them with :func:`~dmuon.comm.make_buckets`).
        plan: the owner plan.
        op: ``"avg"`` (default) or ``"sum"``. An fp16 bucket's mean divides every
            rank's buffer by the world size before the sum, as DDP does (the sum of
            fp16 gradients overflows where their mean does not,
            :mod:`dmuon.comm.averaging`); other dtypes divide the owner's sum.
        group: process group of the plan's ranks (HSDP: the shard group);
            default the world.
        replicate_group: HSDP only, the replicate group of this rank.
        stats: where to record bytes; default :func:`~dmuon.comm.default_stats`.
        verify: first make every rank agree that the inputs are valid and match
            (one small all-gather); a bad input on any rank then raises
            :class:`~dmuon.comm.CollectiveInputError` on every rank instead of
            leaving the others waiting.
        checked: the buckets are known to match ``plan`` (made by
            :func:`~dmuon.comm.make_buckets` from it, or passed through
            :func:`check_buckets`): skip the per-call check of every slot's name,
            shape and owner — what a loop that reduces the same buckets every step
            passes. The groups and ``op`` are still checked.

    Returns:
        A handle whose ``wait()`` gives ``{name: tensor}`` for the items this rank
        owns: views into its buckets holding the reduced values.

    Raises:
        ValueError: a group whose size does not match the plan, buckets that do not
            match the plan (names, shapes, owners), an integer bucket with
            ``op="avg"``, or a bad ``op``.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners, make_buckets, reduce_to_owners
        >>> plan = plan_owners([MatrixItem("w", (2, 2))], 1)
        >>> (bucket,) = make_buckets(plan)
        >>> _ = bucket.view("w").fill_(3.0)
        >>> reduce_to_owners([bucket], plan).wait()["w"]  # one rank: the average is itself
        tensor([[3., 3.],
                [3., 3.]])
    """
    name = "reduce_to_owners"
    stats = stats if stats is not None else default_stats()

    def check() -> tuple[bool, tuple[int, int, int]]:
        average = _reduce_op(op)
        mesh = _mesh(plan, group, replicate_group, name)
        if not checked:
            _check_buckets(plan, buckets, name)
        if average:
            for b in buckets:
                if not b.dtype.is_floating_point:
                    raise ValueError(
                        f"{name}: op='avg' needs floating-point buckets, got {b.dtype} "
                        f"(owner {b.owner}); use op='sum' for integers"
                    )
        return average, mesh

    if verify:
        fp = fingerprint(name, plan.digest(), _layouts(buckets), str(op))
        average, (S, R, me) = agree(name, [group, replicate_group], check, fp)
    else:
        average, (S, R, me) = check()
    stats.count_call(name)
    # fp16 means divide first (DDP's order): a sum past 65504 overflows where the mean
    # does not (dmuon.comm.averaging); the other dtypes divide the sum on the owner
    first = {id(b) for b in buckets if average and b.dtype in DIVIDED_BEFORE_THE_SUM}
    if plan.world_size > 1:
        for b in buckets:
            if id(b) in first:
                b.buffer.div_(plan.world_size)
    works = []
    if S > 1:
        for b in buckets:
            works.append(dist.reduce(b.buffer, group_dst=b.owner % S, group=group, async_op=True))
            stats.record_collective(name, "reduce", nbytes=b.nbytes, world_size=S)
    my_shard = me % S

    def finish() -> dict[str, torch.Tensor]:
        if R > 1:
            second = []
            for b in buckets:
                if b.owner % S == my_shard:
                    second.append(
                        dist.reduce(
                            b.buffer, group_dst=b.owner // S, group=replicate_group, async_op=True
                        )
                    )
                    stats.record_collective(name, "reduce", nbytes=b.nbytes, world_size=R)
            for w in second:
                wait_work(
                    w,
                    "reduce to owners (replicate stage)",
                    replicate_group,
                    device=_device_of(buckets),
                )
        owned: dict[str, torch.Tensor] = {}
        for b in buckets:
            if b.owner == me:
                if average and plan.world_size > 1 and id(b) not in first:
                    b.buffer.div_(plan.world_size)
                owned.update(b.views())
        return owned

    return CommHandle(
        works, finish, what="reduce to owners", group=group, device=_device_of(buckets)
    )


def broadcast_from_owners(
    buckets: Sequence[FlatBucket],
    plan: OwnerPlan,
    *,
    group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    stats: CommStats | None = None,
    verify: bool = False,
    checked: bool = False,
) -> CommHandle[dict[str, torch.Tensor]]:
    """Send every bucket from its owner to all ranks: ``X_rank ← X_owner``.

    One ``dist.broadcast`` per bucket, all started at once. The owner fills its
    buckets first (write into :meth:`~dmuon.comm.FlatBucket.view` or
    :meth:`~dmuon.comm.FlatBucket.pack`); on the other ranks the buckets are
    overwritten. With an HSDP plan: first from replica ``i`` across the owner's
    replicate group, then from shard index ``j`` within every shard group (started
    when the handle is waited on).

    Args:
        buckets: the same layouts on every rank (:func:`~dmuon.comm.make_buckets`).
        plan: the owner plan.
        group: process group of the plan's ranks (HSDP: the shard group).
        replicate_group: HSDP only, the replicate group of this rank.
        out: optional destinations (e.g. the parameters) the received values are
            copied into on ``wait()``; names not in ``out`` are left in the buckets.
        stats: where to record bytes; default :func:`~dmuon.comm.default_stats`.
        verify: agree across ranks on valid, matching inputs first (see
            :func:`reduce_to_owners`).
        checked: the buckets are known to match ``plan`` (see
            :func:`reduce_to_owners`).

    Returns:
        A handle whose ``wait()`` gives ``{name: tensor}`` for every item in the
        buckets (views into them).

    Raises:
        ValueError: a group that does not match the plan, buckets that do not
            match it, or an ``out`` tensor whose shape differs from its item.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners, make_buckets, broadcast_from_owners
        >>> plan = plan_owners([MatrixItem("w", (3,  2))], 1)
        >>> (bucket,) = make_buckets(plan)
        >>> param = torch.zeros(3, 2)
        >>> _ = bucket.view("w").fill_(1.0)
        >>> _ = broadcast_from_owners([bucket], plan, out={"w": param}).wait()
        >>> param.sum().item()
        6.0
    """
    name = "broadcast_from_owners"
    stats = stats if stats is not None else default_stats()

    def check() -> tuple[int, int, int]:
        mesh = _mesh(plan, group, replicate_group, name)
        if not checked:
            _check_buckets(plan, buckets, name)
        if out is not None:
            for key, t in out.items():
                if key not in plan:
                    raise ValueError(f"{name}: out has {key!r}, which is not an item of the plan")
                if tuple(t.shape) != plan.item(key).shape:
                    raise ValueError(
                        f"{name}: out[{key!r}] has shape {tuple(t.shape)}, the plan says "
                        f"{plan.item(key).shape}"
                    )
        return mesh

    if verify:
        fp = fingerprint(name, plan.digest(), _layouts(buckets))
        S, R, me = agree(name, [group, replicate_group], check, fp)
    else:
        S, R, me = check()
    stats.count_call(name)
    my_shard = me % S

    def shard_stage() -> list[object]:
        works = []
        if S > 1:
            for b in buckets:
                works.append(
                    dist.broadcast(b.buffer, group_src=b.owner % S, group=group, async_op=True)
                )
                stats.record_collective(name, "broadcast", nbytes=b.nbytes, world_size=S)
        return works

    first: list[object] = []
    if R > 1:
        for b in buckets:
            if b.owner % S == my_shard:
                first.append(
                    dist.broadcast(
                        b.buffer, group_src=b.owner // S, group=replicate_group, async_op=True
                    )
                )
                stats.record_collective(name, "broadcast", nbytes=b.nbytes, world_size=R)
    else:
        first = shard_stage()

    def finish() -> dict[str, torch.Tensor]:
        if R > 1:
            for w in shard_stage():
                wait_work(
                    w, "broadcast from owners (shard stage)", group, device=_device_of(buckets)
                )
        result: dict[str, torch.Tensor] = {}
        for b in buckets:
            result.update(b.views())
            if out is not None:
                b.unpack_into(out)
        return result

    return CommHandle(
        first,
        finish,
        what="broadcast from owners",
        group=group if R == 1 else replicate_group,
        device=_device_of(buckets),
    )
