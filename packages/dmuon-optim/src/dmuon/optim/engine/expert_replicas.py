"""Expert stacks held by several ranks in owner mode: one owner among the replicas.

On a ``dp × ep`` mesh each rank's experts (its block of every stack split over ``ep``)
are also held by its ``dp`` replicas. Owner mode (``ddp.dedicate``) gives each stack one
owner among them (:func:`~dmuon.optim.engine.expert_split.replica_owners`) — the owner
idea of DMuon (Chen et al., 2026) applied within each replica set, as ``replicated``
mode does for the experts:

1. the stacks' gradients are summed into their owners while backward goes on: a bucket
   per layer, owner and dtype (every stack of that owner in the layer in one flat buffer,
   with a presence flag per stack: a stack no replica had a gradient for keeps none),
   launched as one ``reduce`` over ``dp`` as soon as backward has produced its gradients
   (:meth:`ExpertReplicas.grad_ready`, from the post-accumulate-grad hook
   :func:`~dmuon.integrations.install_hooks` puts on each stack, through
   :meth:`~dmuon.optim.engine.reduction.Reduction.expert_grad_ready`, to the replica
   sets the optimizer's engine attached) and every
   earlier bucket was launched; :meth:`ExpertReplicas.reduce` launches the rest (zeros
   for a stack without a gradient) and waits for them all;
2. the owner steps its stacks (the others hold placeholder state);
3. :meth:`ExpertReplicas.start_broadcast` sends the stepped experts back, in forward
   order (layers in natural order): a stack of :data:`PACK_BYTES` or more straight from
   the owner's experts into the replicas' (one ``broadcast`` each, no copy: the experts
   are most of a MoE model's bytes, and a flat copy of them all would add that much to
   the step's peak memory), the smaller stacks of one owner and dtype packed into one
   flat ``broadcast``. They travel on while the dense layers step and while the next
   forward runs the layers before them: the forward pre-hook of a stack's layer (the
   module its ``layer_key`` names, the transformer block, as for the dense layers; where
   that is a container a forward never calls, the first module below it that is not
   one) waits for the stack's broadcast only
   (:meth:`ExpertReplicas.wait_stacks`, through
   :meth:`~dmuon.optim.engine.publication.Publication.experts_enter`), as the dense
   layers' publications are waited (:mod:`~dmuon.optim.engine.publication`); every point
   that reads or writes the weights otherwise (``wait_all_published``: ``ded.wait()``,
   ``ded.remove()``, a checkpoint, the model's ``state_dict`` and ``load_state_dict``,
   the next step) waits for them all (:meth:`ExpertReplicas.wait_broadcast`). A stack
   whose gradient arrives while its broadcast was never waited was read by a forward
   that did not call that module: :meth:`ExpertReplicas.grad_ready` refuses
   it, on every replica, rather than let the replicas train on last step's weights.

At bind (:meth:`ExpertReplicas.synchronize`, once per set of stacks) every replica takes
the experts of its set's first rank, as the dense layers take rank 0's at ``dedicate``.

**Hang freedom**, as for the dense layers (:mod:`~dmuon.optim.engine.reduction`): the
buckets are launched in one fixed order on every replica — layers in reverse natural
order, the usual backward order — and a bucket only after every earlier one, so a
replica whose backward skipped a stack launches it, and the ones after it, at
:meth:`ExpertReplicas.reduce`, in the same order as the others did in backward.

Over a replica set of ``R`` ranks that is ``2 (R − 1)/R`` of the experts' bytes per rank,
as one all-reduce, while each stack is orthogonalised once instead of ``R`` times.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, MatrixItem
from dmuon.comm.faults import wait_work
from dmuon.comm.owner_plan import natural_key
from dmuon.optim.engine.expert_split import replica_owners
from dmuon.optim.engine.params import EngineParam
from dmuon.optim.engine.taken_gradients import TakenGradients
from dmuon.optim.matrix_split import local_tensor

__all__ = ["EXPERT_REPLICAS_STATS_NAME", "ExpertReplicas"]

EXPERT_REPLICAS_STATS_NAME = "expert_replicas"
"""The ``CommStats`` name of the experts' reduce to their owner among the replicas and of
the broadcast back."""

PACK_BYTES = 2**20
"""A stack of this rank's experts holding fewer bytes is broadcast back packed with the
other small stacks of its owner and dtype; a larger one alone, in place (1 MiB, as owner
mode packs its small layers: ``DEFAULT_PACK_MB``)."""


def _versions(g: torch.Tensor) -> tuple[int, int]:
    """The version counters of gradient ``g`` and of its local tensor: a write through the
    DTensor counts on the first, one through ``g.to_local()`` on the second (writes that
    count on neither go unseen)."""
    return g._version, local_tensor(g)._version


class _Bucket:
    """The stacks of one layer held by one owner, of one dtype: one ``reduce`` a step."""

    def __init__(self, owner: int, members: list[EngineParam]) -> None:
        self.owner = owner
        self.members = members
        self.ready: set[int] = set()  # ids of the members whose gradient arrived
        self.work: Any = None
        self.flat: torch.Tensor | None = None

    @property
    def launched(self) -> bool:
        return self.flat is not None


class _Sent:
    """One broadcast of stepped experts back from their owner, in flight until waited."""

    def __init__(
        self, work: Any, flat: torch.Tensor | None, members: list[EngineParam], s: _ReplicaSet
    ) -> None:
        self.work = work
        self.flat = flat  # the packed buffer (None: received in place)
        self.members = members
        self.set = s
        self.done = False


class _ReplicaSet:
    """One group of ranks holding the same experts and the stacks they share."""

    def __init__(self, group: dist.ProcessGroup, params: Sequence[EngineParam]) -> None:
        self.group = group
        self.ranks = sorted(dist.get_process_group_ranks(group))
        self.params = list(params)
        items = [
            MatrixItem(e.name, tuple(local_tensor(e.param).shape), e.param.dtype) for e in params
        ]
        owners = replica_owners(items, len(self.ranks))
        self.owner = {id(e.param): owners[e.name] for e in params}
        self.name = {id(e.param): e.name for e in params}
        me = self.ranks.index(dist.get_rank())
        self.mine = {id(e.param) for e in params if owners[e.name] == me}
        # the broadcasts back, in one order on every replica, the next forward's (by
        # the natural order of their first stack): per (owner index, dtype), each stack
        # of PACK_BYTES or more alone and in place (packed False), the smaller ones in
        # one flat buffer
        runs: dict[tuple[int, torch.dtype], list[EngineParam]] = {}
        for e in sorted(params, key=lambda e: natural_key(e.name)):
            runs.setdefault((owners[e.name], e.param.dtype), []).append(e)
        sends: list[tuple[int, list[EngineParam], bool]] = []
        for (owner, _), members in runs.items():
            small = []
            for e in members:
                local = local_tensor(e.param)
                # by size alone, the same on every replica (not by a layout of this rank's)
                if local.numel() * local.element_size() >= PACK_BYTES:
                    sends.append((owner, [e], False))
                else:
                    small.append(e)
            if small:
                sends.append((owner, small, True))
        self.sends = sorted(sends, key=lambda t: (natural_key(t[1][0].name), t[0]))
        # the reductions: per layer, owner and dtype, layers in reverse natural order
        by_bucket: dict[tuple[str, int, str], list[EngineParam]] = {}
        for e in sorted(params, key=lambda e: natural_key(e.name)):
            key = (e.layer, owners[e.name], str(e.param.dtype))
            by_bucket.setdefault(key, []).append(e)
        order = sorted(by_bucket, key=lambda k: (natural_key(k[0]), k[1], k[2]))
        self.buckets = [_Bucket(k[1], by_bucket[k]) for k in reversed(order)]
        self.bucket_of = {id(e.param): b for b in self.buckets for e in b.members}
        self.next_launch = 0


class ExpertReplicas:
    """The replica sets of owner mode's in-place expert stacks (see the module docstring).

    Args:
        groups: per group of ranks holding the same experts (``dp`` of a ``dp × ep``
            mesh), the stacks they share.
        stats: where the collectives are counted (:data:`EXPERT_REPLICAS_STATS_NAME`).
        free_local_grads: set each stack's local ``p.grad`` to ``None`` once it is copied
            into its bucket (the dedication's ``free_local_grads``): backward then holds
            the bucket, not the bucket and the gradients; the owner's gradient is set to
            the sum at :meth:`reduce` (a view of the bucket: no copy either).
    """

    def __init__(
        self,
        groups: Sequence[tuple[dist.ProcessGroup, Sequence[EngineParam]]],
        stats: CommStats,
        free_local_grads: bool = False,
    ) -> None:
        self.sets = [_ReplicaSet(g, params) for g, params in groups]
        self.stats = stats
        self.free_local_grads = free_local_grads
        self._by_param = {pid: s for s in self.sets for pid in s.owner}
        # the broadcasts back in flight, and per stack the ones that carry it
        self._pending: list[_Sent] = []
        self._pending_of: dict[int, list[_Sent]] = {}
        # the stacks sent since the forward pre-hook of their layer last waited for them
        # (wait_stacks) or every rank waited for them all (mark_all_waited): a gradient of
        # one comes from a forward past that wait. Only calls every replica makes change
        # it (not a wait of a state_dict() on one rank), so every replica refuses alike
        self._unwaited: set[int] = set()
        # each gradient copied into a bucket, as it was then (by both version counters):
        # a change after that would not reach the owner
        self._taken = TakenGradients(_versions)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Give every replica the experts of the first rank of its replica set (``dp``
        rank 0), as ``DistributedDataParallel`` and the dedication give every rank rank
        0's weights when they are built: a model loaded on rank 0 alone starts every
        replica from that load, where otherwise each stack's owner kept its own experts
        and the replicas trained the first step on theirs. One ``broadcast`` per stack,
        in place, in the natural order of the stacks on every replica."""
        for s in self.sets:
            if len(s.ranks) == 1:
                continue
            works = [
                (
                    e,
                    dist.broadcast(
                        local_tensor(e.param), src=s.ranks[0], group=s.group, async_op=True
                    ),
                )
                for e in sorted(s.params, key=lambda e: natural_key(e.name))
            ]
            for e, work in works:
                wait_work(work, f"broadcast of expert stack {e.name!r} from dp rank 0", s.group)

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self._by_param

    def same_stacks(self, other: ExpertReplicas) -> bool:
        """Whether ``other`` holds the same stacks in the same replica sets (another
        optimizer's over the same dedication)."""

        def key(r: ExpertReplicas) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
            return [(tuple(s.ranks), tuple(id(e.param) for e in s.params)) for s in r.sets]

        return key(self) == key(other)

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

    def _flat(self, members: list[EngineParam], grads: bool, *tail: torch.Tensor) -> torch.Tensor:
        """The members' gradients (``grads``) or weights, then ``tail``, in one buffer: one
        copy (zeros for a missing gradient)."""
        parts = []
        for e in members:
            local = local_tensor(e.param)
            g = e.param.grad if grads else e.param
            parts.append(
                (local_tensor(g) if g is not None else torch.zeros_like(local)).reshape(-1)
            )
        return torch.cat([*parts, *tail])

    def _count(self, op: str, flat: torch.Tensor, s: _ReplicaSet) -> None:
        nbytes = flat.numel() * flat.element_size()
        self.stats.record_collective(
            EXPERT_REPLICAS_STATS_NAME, op, nbytes=nbytes, world_size=len(s.ranks)
        )

    def grad_ready(self, p: torch.Tensor, syncing: bool = True) -> None:
        """A gradient of stack ``p`` has been accumulated (from a post-accumulate-grad
        hook): launch its bucket's reduction once the bucket is complete and every earlier
        one was launched. ``syncing=False`` (inside ``no_sync()``): nothing is launched, the
        gradient accumulates for a later backward."""
        s = self._by_param.get(id(p))
        if s is None:
            return
        if id(p) in self._unwaited:
            raise RuntimeError(
                f"expert stack {s.name[id(p)]!r} got a gradient from a forward that ran "
                "past the wait for its stepped weights from their owner among the "
                "replicas: the forward pre-hook of its layer (the module its layer_key "
                "names, or the first below it that a forward calls) waits for them after "
                "each step, and it was not called since (its forward was run past its "
                "hooks, or the stack read outside it). Call the layer as a module, or "
                "ded.wait() on every rank after opt.step()"
            )
        if not syncing:
            return
        bucket = s.bucket_of[id(p)]
        if bucket.launched:
            raise RuntimeError(
                f"a second gradient of expert stack {s.name[id(p)]!r} arrived after it was "
                "reduced to its owner among the replicas; call backward once per optimizer "
                "step, or run the earlier micro-batches inside no_sync(); to drop a batch "
                "after its backward, call the optimizer's zero_grad()"
            )
        bucket.ready.add(id(p))
        while s.next_launch < len(s.buckets):
            nxt = s.buckets[s.next_launch]
            if len(nxt.ready) < len(nxt.members):
                break
            self._launch(s, nxt)

    @torch.no_grad()
    def _launch(self, s: _ReplicaSet, bucket: _Bucket) -> None:
        # the gradients, then one presence flag per stack: summed with them, a flag that
        # stays 0 says no replica had a gradient, and the owner leaves the stack without
        # one (not stepped, as one process skips a parameter without a gradient)
        first = local_tensor(bucket.members[0].param)
        present = torch.tensor(
            [float(e.param.grad is not None) for e in bucket.members],
            dtype=first.dtype,
            device=first.device,
        )
        flat = self._flat(bucket.members, True, present)
        for e in bucket.members:
            if self.free_local_grads:  # copied: the bucket holds it now
                e.param.grad = None
            else:
                self._taken.take(id(e.param), e.name, e.param)
        self._count("reduce", flat, s)
        bucket.work = dist.reduce(flat, dst=s.ranks[bucket.owner], group=s.group, async_op=True)
        bucket.flat = flat
        s.next_launch += 1

    def flush(self) -> None:
        """Launch every bucket not launched yet (zeros for missing gradients)."""
        for s in self.sets:
            while s.next_launch < len(s.buckets):
                self._launch(s, s.buckets[s.next_launch])

    def started(self) -> bool:
        """Whether a gradient arrived for a stack since the last :meth:`reduce`."""
        return any(b.ready or b.launched for s in self.sets for b in s.buckets)

    def changed_gradients(self) -> list[str]:
        """Stacks whose gradient was changed (in place, or replaced) after it was copied
        into its bucket this step: the change would not reach the owner."""
        return self._taken.changed()

    @torch.no_grad()
    def reduce(self, write: bool = True) -> None:
        """Launch what backward did not (:meth:`flush`) and wait for every bucket under the
        step's deadline; with ``write``, the owner's gradient becomes the sum (``False``:
        a skipped or discarded step only drains the collectives)."""
        from torch.distributed.tensor import DTensor

        self.flush()
        me = dist.get_rank()
        owned: list[tuple[_Bucket, torch.Tensor]] = []
        for s in self.sets:
            for bucket in s.buckets:
                flat = bucket.flat
                assert flat is not None
                # before the gradients are replaced: the changes made since the launch
                self._taken.settle(id(e.param) for e in bucket.members)
                wait_work(
                    bucket.work,
                    "reduce of the experts' gradients to their owner (owner mode)",
                    s.group,
                )
                bucket.work, bucket.flat = None, None
                bucket.ready.clear()
                if write and s.ranks[bucket.owner] == me:
                    owned.append((bucket, flat))
            s.next_launch = 0
        if not owned:
            return
        # every owned stack's presence flag, read at once (one device-to-host copy a step)
        flags = torch.cat([flat[-len(b.members) :] for b, flat in owned]).tolist()
        for bucket, flat in owned:
            offset = 0
            present, flags = flags[: len(bucket.members)], flags[len(bucket.members) :]
            for e, arrived in zip(bucket.members, present, strict=True):
                local = local_tensor(e.param)
                part = flat[offset : offset + local.numel()].view_as(local)
                offset += local.numel()
                if not arrived:  # on no replica: no gradient, as on one process
                    continue
                if e.param.grad is not None:
                    local_tensor(e.param.grad).copy_(part)
                else:  # freed at the launch (a view: the bucket is this step's alone),
                    # or no local gradient on the owner (a copy: the bucket is let go)
                    p: Any = e.param
                    p.grad = DTensor.from_local(
                        part if self.free_local_grads else part.clone(),
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                    )

    def end_step(self) -> None:
        """Forget this step's record of changed gradients (after the step's agreement)."""
        self._taken.clear()

    @torch.no_grad()
    def start_broadcast(self) -> None:
        """Send each owner's stepped experts to its replicas, in the next forward's order
        (waited by :meth:`wait_stacks` and :meth:`wait_broadcast`)."""
        self.wait_broadcast()  # the last step's, should nothing have waited for them
        me = dist.get_rank()
        for s in self.sets:
            for owner, members, packed in s.sends:
                src = s.ranks[owner]
                if not packed:  # one large stack, from and into the experts themselves
                    # (contiguous: DMuon refuses a matrix that is not, group_options.py)
                    flat = None
                    tensor = local_tensor(members[0].param)
                elif src == me:
                    flat = tensor = self._flat(members, grads=False)
                else:  # received: nothing to pack
                    n = sum(local_tensor(e.param).numel() for e in members)
                    flat = tensor = torch.empty(
                        n, dtype=members[0].param.dtype, device=members[0].param.device
                    )
                self._count("broadcast", tensor, s)
                work = dist.broadcast(tensor, src=src, group=s.group, async_op=True)
                sent = _Sent(work, flat, members, s)
                self._pending.append(sent)
                for e in members:
                    self._pending_of.setdefault(id(e.param), []).append(sent)
                    self._unwaited.add(id(e.param))

    def in_flight(self) -> bool:
        """Whether a broadcast of :meth:`start_broadcast` was not waited for yet."""
        return bool(self._pending)

    @torch.no_grad()
    def _finish(self, sent: _Sent) -> None:
        """Wait for one broadcast; the replicas take its packed experts (and the packed
        buffer is let go)."""
        if sent.done:
            return
        wait_work(
            sent.work,
            "broadcast of the stepped experts from their owner (owner mode)",
            sent.set.group,
        )
        flat, sent.flat, sent.done = sent.flat, None, True
        if flat is None:  # received in place
            return
        offset = 0
        for e in sent.members:
            local = local_tensor(e.param)
            part = flat[offset : offset + local.numel()]
            offset += local.numel()
            if id(e.param) not in sent.set.mine:  # the owner sent its own
                # through .data, as a broadcast into the stack itself writes (an in-place
                # one): no autograd version bump, so a forward that read the stack before
                # this wait (outside its layer) read it stale here, as a dense weight's
                # non-owners would, instead of failing backward here and not on its owner
                local.data.copy_(part.view_as(local))

    def wait_stacks(self, ids: Iterable[int]) -> None:
        """The stacks of these parameter ids hold their owners' weights (the forward
        pre-hook of their layer): their broadcasts waited, the others left in flight. A
        wait that fails (a deadline) leaves every broadcast not finished in flight."""
        for pid in ids:
            for sent in self._pending_of.get(pid, ()):
                self._finish(sent)
            self._pending_of.pop(pid, None)
            self._unwaited.discard(pid)
        self._pending = [sent for sent in self._pending if not sent.done]
        if not self._pending:
            self._pending_of.clear()

    def mark_all_waited(self) -> None:
        """Every replica waited for every stack (``ded.wait()``): a forward past the
        layers' hooks reads current stacks, and their gradients are not refused."""
        self._unwaited.clear()

    def wait_broadcast(self) -> None:
        """Wait for every broadcast of :meth:`start_broadcast` still in flight (the
        stacks stay unwaited for :meth:`grad_ready` until their layer's hook runs)."""
        for sent in self._pending:
            self._finish(sent)
        self._pending = []
        self._pending_of.clear()
