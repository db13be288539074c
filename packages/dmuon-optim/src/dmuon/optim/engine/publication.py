"""The broadcast half of owner mode: owners' weights back to every rank.

ZeRO-2-like (default): every rank keeps every dedicated weight. After its step,
each layer's weights are broadcast from their owners at once — one collective per
owner per layer, started as soon as that layer's step is done — and the next
forward waits for a layer only in that layer's pre-hook.

ZeRO-3-like (``reshard_after_forward``): a rank keeps only the weights it owns.
The others are materialised for a layer's forward (broadcast in its forward
pre-hook, the next layer prefetched), freed after it, materialised again for its
backward (in its backward pre-hook, the layer before prefetched) and freed once
backward has moved on to the next layer. Freeing is
``untyped_storage().resize_(0)`` of the layer's broadcast buffer — the public way
FSDP1 freed its flat parameters; the parameters are views of that buffer. A freed
parameter's data becomes one NaN broadcast to its shape (no memory, shape and
dtype kept for code that inspects them), so that reading it outside a forward gives
NaN instead of reading freed memory (which crashes the process), writing to it
raises, and the model's ``state_dict`` refuses it
(:meth:`Publication.released_names`). Traffic
per step: ``3(N−1)/N·P`` (broadcast, re-broadcast, reduce) instead of ``2(N−1)/N·P``.
These broadcasts run on a process group of their own, so their order (set by
forward and backward) never interleaves with the reductions' fixed order.

A tensor-parallel DTensor parameter (owner mode over ``dp × tp``,
:mod:`~dmuon.optim.engine.owner_split`) cannot be a view of its bucket: its owner
copies its shard into the bucket before the broadcast, the other ranks copy it out
once the broadcast is waited on.

A write to a dedicated weight while its publication is in flight (between ``opt.step()``
and the wait, in the layer's forward pre-hook or ``Dedication.wait()``) would be lost:
on a rank that does not own it the broadcast lands over it, on the owner the send may
carry the weight from before or after it, so the ranks would hold different models.
Each parameter's own version counter (and that it is still a view of its slot) is
recorded when its broadcast is launched and compared when it is waited
(:meth:`Publication.written_weights`); the next step's agreement refuses the step on
every rank (:func:`~dmuon.optim.engine.guards.agree_step`). The broadcast itself moves
no parameter's counter: it writes the bucket, whose counter is not the parameter's
(``p.data = view`` keeps ``p``'s own), so only the user's writes through ``p`` count
(``p.mul_``, ``p.copy_``, an ``init`` function, ``p.data = ...``; not a write through
``p.data``, which has a counter of its own; ``load_state_dict`` of the model or a
submodule waits for the broadcasts before it copies, so it is never one).

The expert stacks that owner mode steps where they live on a ``dp × ep`` mesh are
published by their own broadcasts (:mod:`~dmuon.optim.engine.expert_replicas`), which
the optimizer attaches here (:attr:`Publication.experts`): the forward pre-hook of the
layer holding a stack waits for it (:meth:`Publication.experts_enter`), and
:meth:`Publication.wait_all_published` waits for them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dmuon.comm import (
    CollectiveError,
    CommStats,
    FlatBucket,
    OwnerPlan,
    broadcast_from_owners,
    collective_timeout,
    wait_work,
)
from dmuon.comm.process_groups import group_size, twin_groups, twin_slot
from dmuon.comm.roll_call import noted_phase
from dmuon.optim import deadline
from dmuon.optim.engine.layer_record import OwnerLayer
from dmuon.optim.engine.params import is_dtensor
from dmuon.optim.matrix_split import local_tensor

if TYPE_CHECKING:
    from dmuon.optim.engine.expert_replicas import ExpertReplicas

__all__ = ["Publication"]


def _freed(p: torch.Tensor) -> torch.Tensor:
    """What a freed parameter holds: one NaN seen at every index (no memory)."""
    return torch.full((1,), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)


class Publication:
    """The broadcast side of owner mode: the owners' weights back to every rank.

    :class:`~dmuon.optim.engine.OwnerExchange` builds one after its buckets and
    holds it as :attr:`OwnerExchange.publication`; both share the same
    :class:`~dmuon.optim.engine.layer_record.OwnerLayer` records. Building it makes
    every dedicated parameter a view of its slot in its layer's broadcast bucket
    (a collective under ZeRO-3-like: the broadcasts' own process group).

    Args:
        layers: the layer records, in forward order.
        params: every dedicated (and replicated) parameter by name.
        plan: the owner plan.
        rank: this rank in the plan's ranks (HSDP: ``i·S + j``).
        world_size: the number of those ranks.
        group: the plan's process group (HSDP: the shard group); ``None``: the world.
        replicate_group: HSDP only, this rank's replicate group.
        stats: where the bytes are recorded.
        reshard_after_forward: ZeRO-3-like (see the module docstring).

    Attributes:
        timeout: seconds a wait for weights may take (``None``: the group's timeout);
            :class:`~dmuon.optim.DMuon` sets it through the exchange. Until then (at
            ``dedicate()``) it is the floor of ``timeout="auto"``, 300 s.
        published_step: the DMuon step whose weights are in flight (for messages).
        experts: the expert stacks' broadcasts from their owners among the replicas
            (``dp × ep``), which the optimizer attaches (``Reduction.attach_experts``);
            ``None``: no such stack.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> from dmuon.optim import OwnerExchange
        >>> w = torch.nn.Parameter(torch.ones(4, 4))
        >>> item = MatrixItem("blocks.0.w", (4, 4), layer="blocks.0")
        >>> ex = OwnerExchange([(item, w)], plan=plan_owners([item], 1))
        >>> ex.publication.pending_publications(), ex.publication.released_names()
        ([], [])
    """

    def __init__(
        self,
        layers: Sequence[OwnerLayer],
        params: Mapping[str, torch.Tensor],
        plan: OwnerPlan,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        stats: CommStats,
        reshard_after_forward: bool,
    ) -> None:
        self.layers = list(layers)
        # by its key, and a pack of small layers by each of its layers' keys too
        self._by_key = {k: layer for layer in self.layers for k in (layer.key, *layer.members)}
        self._position = {k: i for i, layer in enumerate(self.layers) for k in layer.members}
        self._position.update((layer.key, i) for i, layer in enumerate(self.layers))
        # every layer before this position has no broadcast in flight: a forward's waits
        # go on from where the previous one stopped (work linear in the depth per forward)
        self._finished = 0
        # every layer before this position was waited for by a forward pre-hook (or by a
        # wait every rank made: mark_all_waited) since it was last published; a gradient
        # of a later one comes from a forward past its wait (unwaited). Moved only by
        # calls every rank makes, so every rank gives the same answer
        self._hooked = len(self.layers)
        # per layer key (those with modules holding its weights below the layer's hook):
        # whether the layer's forward is running with its wait done. The integrations'
        # layer pre-hook sets it after its wait, its forward hook clears it (always_call),
        # and so does publish(): a forward interrupted by a BaseException that is not an
        # Exception (KeyboardInterrupt) runs no forward hook, and a mark left set would let
        # a holder called on its own after the next step skip its wait
        # (dmuon.integrations.hooks: the holders' waits read it)
        self.entered: dict[str, bool] = {}
        # each dedicated parameter's layer and owner (released)
        self._home = {
            name: (layer, b.owner)
            for layer in self.layers
            for b in layer.publish_buckets
            for name in b.names
        }
        self._params = params
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.replicate_group = replicate_group
        self.stats = stats
        self.reshard_after_forward = reshard_after_forward
        self.timeout: float | None = deadline.AUTO_FLOOR_SECONDS  # until DMuon sets it
        self.published_step = 0
        self.experts: ExpertReplicas | None = None
        self._backward_resident: list[str] = []
        # per layer key whose broadcast is in flight: each parameter's name, its version
        # counters and data pointer when the broadcast was launched (see written_weights)
        self._sent: dict[str, list[tuple[str, tuple[int, int], int]]] = {}
        # dedicated parameters written while their publication was in flight, found when
        # it was waited; the next step's agreement reads them (written_weights)
        self._written: list[str] = []
        # DTensor shards travel by copies (see the module docstring)
        self._copied = {n for n, p in params.items() if is_dtensor(p)}
        self._alias_all()
        # ZeRO-3-like broadcasts follow forward and backward, the reductions a fixed
        # order: separate process groups keep the two sequences from interleaving.
        self._publish_group = group
        S = group_size(group)
        if reshard_after_forward and S > 1:  # one per process, rank set and dedication
            # (the slot of its reduction twin: another dedication broadcasts on its own)
            self._publish_group = twin_groups([group], purpose="publish", slot=twin_slot(group))[0]

    def _alias_all(self) -> None:
        for layer in self.layers:
            for b in layer.publish_buckets:
                for name in b.names:
                    self._alias(b, name)

    def _alias(self, b: FlatBucket, name: str) -> None:
        """Make parameter ``name`` a view of its slot in broadcast bucket ``b``."""
        if name in self._copied:
            return
        p = self._params[name]
        view = b.view(name)
        if p.data_ptr() == view.data_ptr() and p.dtype == view.dtype:
            return
        if 0 in p.stride() and p.numel() > 1:
            return  # freed (ZeRO-3-like): materialize makes it a view again
        if view.device != p.device:
            raise RuntimeError(
                f"dedicated parameter {name!r} is on {p.device} but was dedicated on "
                f"{view.device}; move the model to its device before dedicating it"
            )
        with torch.no_grad():
            view.copy_(p.detach().reshape(view.shape))
        p.data = view.view(p.shape)

    def _copy_in(self, layer: OwnerLayer, src: int | None = None) -> None:
        """The sender's DTensor shards into their slots, before the broadcast: the owner's
        (``src``: the bucket's first rank of the group sends instead, every rank copies)."""
        with torch.no_grad():
            for b in layer.publish_buckets:
                if src is None and b.owner != self.rank:
                    continue
                for name in b.names:
                    if name in self._copied:
                        view = b.view(name)
                        view.copy_(local_tensor(self._params[name]).reshape(view.shape))

    def _copy_out(self, layer: OwnerLayer, src: int | None = None) -> None:
        """The received DTensor shards out of their slots, once the broadcast is waited
        (``src``: not the owners' broadcast, every rank copies)."""
        with torch.no_grad():
            for b in layer.publish_buckets:
                if src is None and b.owner == self.rank:
                    continue
                for name in b.names:
                    if name in self._copied:
                        shard = local_tensor(self._params[name])
                        shard.copy_(b.view(name).view(shard.shape))

    def _finish(self, layer: OwnerLayer) -> None:
        """Wait for ``layer``'s broadcast in flight (if any) and land its copies; note the
        parameters written meanwhile (:meth:`written_weights`), before the copies land
        (they write the DTensor shards themselves)."""
        if layer.publish_handle is not None:
            layer.publish_handle.wait()
            layer.publish_handle = None
            self._written += self._moved(layer.key, forget=True)
            self._copy_out(layer)

    def _stamp(self, name: str) -> tuple[tuple[int, int], int]:
        """Parameter ``name``'s version counters (its own and its local shard's) and data
        pointer, as :meth:`written_weights` compares them."""
        p = self._params[name]
        local = local_tensor(p)
        return (p._version, local._version), local.data_ptr()

    def _record_sent(self, layer: OwnerLayer) -> None:
        """Note each parameter of ``layer`` as its broadcast is launched."""
        self._sent[layer.key] = [
            (name, *self._stamp(name)) for b in layer.publish_buckets for name in b.names
        ]

    def _moved(self, key: str, forget: bool = False) -> list[str]:
        """The parameters of layer ``key`` written since its broadcast was launched: a
        version counter moved, or the data replaced (``p.data = ...``: no longer the
        tensor it was, a view of its slot)."""
        sent = self._sent.pop(key, []) if forget else self._sent.get(key, [])
        return [name for name, *stamp in sent if tuple(stamp) != self._stamp(name)]

    def written_weights(self) -> list[str]:
        """The dedicated parameters this rank wrote while their publication was in flight
        (after ``opt.step()``, before the wait: their layer's forward pre-hook, or
        ``Dedication.wait()``), found since the last call (then forgotten), and those of
        the layers still in flight written already.

        Such a write is lost, on the ranks that do not own the parameter (the broadcast
        lands over it) or on the owner (its send may carry the weight from before the
        write): the ranks would train different models. The step's agreement reads this
        once per step and refuses the step on every rank
        (:class:`~dmuon.optim.RankDivergenceError`).
        """
        found, self._written = self._written, []
        for key in list(self._sent):
            found += self._moved(key)
        return list(dict.fromkeys(found))

    def _broadcast(self, layer: OwnerLayer) -> None:
        self._finished = min(self._finished, self._position[layer.key])
        self._copy_in(layer)
        layer.publish_handle = broadcast_from_owners(
            layer.publish_buckets,
            self.plan,
            group=self._publish_group,
            replicate_group=self.replicate_group,
            stats=self.stats,
            checked=True,  # made by make_buckets from this plan (layer_record.py)
        )

    def publish(self, key: str) -> None:
        """Layer ``key`` was stepped: start broadcasting its weights from their owners.

        ZeRO-3-like: nothing travels now; the layer's next forward materialises it.
        """
        layer = self._by_key[key]
        for k in (layer.key, *layer.members):
            if k in self.entered:
                self.entered[k] = False  # new weights: no forward has waited for them yet
        if self.reshard_after_forward:
            self.release(key)
            return
        for b in layer.publish_buckets:
            for name in b.names:
                self._alias(b, name)  # the model was moved or its data replaced: re-alias
        if layer.publish_buckets and self.world_size > 1:
            self._broadcast(layer)
            self._record_sent(layer)
            self._hooked = min(self._hooked, self._position[key])

    def unwaited(self, key: str) -> bool:
        """Whether layer ``key`` was published (ZeRO-2-like) and no forward pre-hook waited
        for it since (nor a wait every rank made: :meth:`mark_all_waited`): a gradient of it
        comes from a forward that ran past the wait, and read the weights before they
        arrived, or while they did. The same answer on every rank (only the hooks and
        waits every rank makes move it, not a ``state_dict()`` on one rank)."""
        return (
            not self.reshard_after_forward
            and self._position[key] >= self._hooked
            and bool(self._by_key[key].publish_buckets)
        )

    def mark_all_waited(self) -> None:
        """Every rank waited for every layer (``OwnerExchange.wait_all_published``, which
        ``Dedication.wait()`` calls): a forward past the hooks reads current weights (and
        current expert stacks)."""
        self._hooked = len(self.layers)
        if self.experts is not None:
            self.experts.mark_all_waited()

    @contextlib.contextmanager
    def _deadline(self, where: str) -> Iterator[None]:
        """Every wait inside under DMuon's deadline; a :class:`CollectiveError` names the
        ranks that did not answer the roll call, and where this rank was. ``where`` is this
        rank's phase meanwhile, so a roll call lists ranks waiting for different layers
        (a layer run on some ranks only, ZeRO-3-like)."""
        try:
            with noted_phase(where), collective_timeout(self.timeout):
                yield
        except CollectiveError as err:
            hint = (
                " (reshard_after_forward=True: every rank re-gathers each layer it runs, so "
                "a layer run on some ranks only leaves the ranks waiting for different "
                "layers' weights; run every dedicated layer on every rank, or keep the "
                "weights resident)"
                if self.reshard_after_forward
                else ""
            )
            raise err.after_roll_call().with_context(
                f"rank {self.rank}, {where}: waiting for the weights published by DMuon step "
                f"{self.published_step}{hint}"
            ) from err

    def wait_published(self, key: str) -> None:
        """Make layer ``key`` hold the owners' weights (the forward pre-hook calls this);
        the key of a layer packed with others (:attr:`OwnerLayer.members
        <dmuon.optim.engine.layer_record.OwnerLayer>`) stands for its whole pack.

        ZeRO-2-like: wait for its publication (and every earlier layer's, so that the
        second stage of HSDP broadcasts is issued in one order on every rank).
        ZeRO-3-like: materialise it. Every wait is under :attr:`timeout`.
        """
        if self._landed(key):
            return
        with self._deadline(f"before layer {key!r} runs"):
            self._wait_published(key)

    def _landed(self, key: str) -> bool:
        """ZeRO-2-like: layer ``key``'s broadcast (and every earlier layer's) already
        landed, so a wait has nothing to do: the hooks of every module holding a weight
        ask this first, without entering the deadline and the roll call's phase note."""
        return not self.reshard_after_forward and self._finished > self._position[key]

    def _wait_published(self, key: str) -> None:
        if self.reshard_after_forward:
            self.materialize(key)
            return
        position = self._position[key]
        while self._finished <= position:
            self._finish(self.layers[self._finished])
            self._finished += 1

    def wait_all_published(self) -> None:
        """Every layer holds the owners' weights (ZeRO-3-like: materialises them all), and
        every expert stack its owner's (:attr:`experts`)."""
        self.wait_all_layers()
        self.wait_experts()

    def wait_all_layers(self) -> None:
        """Every layer holds the owners' weights (ZeRO-3-like: materialises them all); the
        expert stacks' broadcasts (:attr:`experts`) travel on."""
        for layer in self.layers:
            self.wait_published(layer.key)

    def wait_experts(self) -> None:
        """Every expert stack holds its owner's weights (:attr:`experts`)."""
        if self.experts is not None and self.experts.in_flight():
            with self._deadline("before the expert stacks are read"):
                self.experts.wait_broadcast()

    def wait_in_flight(self) -> None:
        """The broadcasts already in flight land, before the weights are read, loaded or
        left without hooks: ZeRO-2-like every one; ZeRO-3-like the expert stacks' (the
        dense layers' travel only inside a forward or backward). Issues no collective
        the other ranks do not issue in their next forward anyway."""
        self.wait_experts()
        # every layer before _finished is known landed: nothing to look at (the
        # state-dict and load hooks of every module holding a weight call this)
        if not self.reshard_after_forward and self._finished < len(self.layers):
            self.wait_all_layers()

    def experts_enter(self, ids: Iterable[int], where: str) -> None:
        """Forward pre-hook of a layer holding expert stacks (``ids``: the parameters'
        ``id``): they hold their owners' weights; the other stacks' broadcasts travel on.
        ``where`` names the layer in a timeout's message."""
        if self.experts is None:
            return
        if self.experts.in_flight():
            with self._deadline(f"before the expert stacks of {where} run"):
                self.experts.wait_stacks(ids)
        else:  # landed already (a wait on this rank): the hook still counts as their wait
            self.experts.wait_stacks(ids)

    def pending_publications(self) -> list[str]:
        """Layers whose broadcast is in flight (and ``"experts"`` while an expert stack's
        is)."""
        pending = [layer.key for layer in self.layers if layer.publish_handle is not None]
        if self.experts is not None and self.experts.in_flight():
            pending.append("experts")
        return pending

    # -------------------------------------------------------------- ZeRO-3-like

    def materialize(self, key: str, wait: bool = True) -> None:
        """Bring back layer ``key``'s weights on the ranks that do not own them.

        A no-op unless ZeRO-3-like or when the layer is resident. Every rank must call
        it at the same points (the hooks do): the decision depends only on calls
        every rank makes.
        """
        layer = self._by_key[key]
        if not layer.resident:
            for b in layer.publish_buckets:
                if b.owner != self.rank:
                    b.buffer.untyped_storage().resize_(b.numel * b.buffer.element_size())
                    for name in b.names:  # a view of the buffer again
                        p = self._params[name]
                        p.data = b.view(name).view(p.shape)
            if self.world_size > 1 and layer.publish_buckets:
                self._broadcast(layer)
            layer.resident = True
        if wait and layer.publish_handle is not None:
            layer.publish_handle.wait()
            layer.publish_handle = None

    def release(self, key: str) -> None:
        """Free layer ``key``'s weights on the ranks that do not own them (ZeRO-3-like)."""
        layer = self._by_key[key]
        if not self.reshard_after_forward or not layer.resident:
            return
        if layer.publish_handle is not None:  # a prefetch nobody used
            layer.publish_handle.wait()
            layer.publish_handle = None
        for b in layer.publish_buckets:
            if b.owner != self.rank:
                b.buffer.untyped_storage().resize_(0)
                for name in b.names:  # no view of freed memory stays readable
                    p = self._params[name]
                    p.data = _freed(p)
        layer.resident = False

    def released(self, name: str) -> bool:
        """Whether dedicated parameter ``name`` is freed on this rank right now
        (ZeRO-3-like, outside a forward)."""
        home = self._home.get(name)
        return home is not None and not home[0].resident and home[1] != self.rank

    def released_names(self) -> list[str]:
        """Parameters freed on this rank right now (ZeRO-3-like, outside a forward)."""
        return [
            name
            for layer in self.layers
            if not layer.resident
            for b in layer.publish_buckets
            if b.owner != self.rank
            for name in b.names
        ]

    def forward_enter(self, key: str) -> None:
        """Forward pre-hook: layer ``key`` holds the owners' weights; under ZeRO-3-like,
        the next layer is prefetched."""
        if self._landed(key):
            self._hooked = max(self._hooked, self._position[key] + 1)
            return
        with self._deadline(f"before layer {key!r} runs"):
            self._wait_published(key)
            self._hooked = max(self._hooked, self._position[key] + 1)
            if self.reshard_after_forward:
                nxt = self._neighbour(key, +1)
                if nxt is not None:
                    self.materialize(nxt, wait=False)

    def forward_exit(self, key: str) -> None:
        """Forward post-hook: free layer ``key`` (ZeRO-3-like)."""
        with self._deadline(f"after the forward of layer {key!r}"):
            self.release(key)

    def backward_enter(self, key: str) -> None:
        """Backward pre-hook: free the layers backward has finished, materialise ``key``,
        prefetch the layer before it.

        Every wait is under :attr:`timeout`: a rank that never runs this layer's
        backward (a layer used on some ranks only) or stalls before it makes the others
        raise :class:`~dmuon.comm.CollectiveError` naming it, instead of hanging.
        """
        if not self.reshard_after_forward:
            return
        with self._deadline(f"before the backward of layer {key!r} (ZeRO-3-like re-gather)"):
            for done in self._backward_resident:
                if done != key:
                    self.release(done)
            self._backward_resident = [key]
            self.materialize(key)
            prev = self._neighbour(key, -1)
            if prev is not None:
                self.materialize(prev, wait=False)
                self._backward_resident.append(prev)

    def _neighbour(self, key: str, offset: int) -> str | None:
        i = self._position[key] + offset
        return self.layers[i].key if 0 <= i < len(self.layers) else None

    def end_step(self) -> None:
        """Forget which layers backward kept materialised (the step is over)."""
        self._backward_resident = []

    def release_all(self) -> None:
        """Free every layer a rank does not own (ZeRO-3-like; after the step's flush)."""
        for layer in self.layers:
            self.release(layer.key)
        self._backward_resident = []

    def synchronize_parameters(self) -> None:
        """Give every rank rank 0's weights, as ``DistributedDataParallel`` does when it is
        built: the dedicated ones (each broadcast bucket in place from the group's first
        rank, then over the replicate group under HSDP) and the replicated ones. A model
        loaded on rank 0 alone starts every rank from that load (each matrix from its
        owner, as before, took the owners' own weights: rank 0's load was lost for every
        matrix another rank owns)."""
        if self.world_size == 1:
            return
        buckets = [b for layer in self.layers for b in layer.publish_buckets]
        for layer in self.layers:  # DTensor shards travel by copies
            self._copy_in(layer, src=0)
        groups = (
            [self.group] if self.replicate_group is None else [self.group, self.replicate_group]
        )
        for g in groups:  # HSDP: the replicas' first ranks hold rank 0's after the first
            if group_size(g) == 1:
                continue
            works = [dist.broadcast(b.buffer, group_src=0, group=g, async_op=True) for b in buckets]
            for work in works:
                wait_work(work, "broadcast of rank 0's dedicated weights", g)
        for layer in self.layers:
            self._copy_out(layer, src=0)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for layer in self.layers:
            for n in layer.replicated:
                by_dtype.setdefault(self._params[n].dtype, []).append(n)
        for names in by_dtype.values():
            # a DTensor's local part: the dp ranks of one tp column hold the same shard
            tensors = {n: local_tensor(self._params[n]).detach() for n in names}
            b = FlatBucket.from_tensors(tensors)
            work = dist.broadcast(b.buffer, group_src=0, group=self.group, async_op=True)
            wait_work(work, "broadcast of rank 0's replicated parameters", self.group)
            with torch.no_grad():
                b.unpack_into(tensors)
