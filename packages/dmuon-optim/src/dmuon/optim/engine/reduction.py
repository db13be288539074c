"""The reduction half of owner mode: gradients reduced to their owners, layer by layer.

Every dedicated parameter's gradient is reduced (averaged, or summed with
``reduce_op="sum"``) to its owner only, layer
by layer, as soon as backward has produced a layer's gradients (:meth:`Reduction.
grad_ready`, called from a post-accumulate-grad hook), so the reductions overlap the
rest of backward. *Replicated* parameters (the scalar parameters when this replaces
DDP) are all-reduced in the same layer buckets instead.

**Hang freedom.** Hooks fire in backward order, which differs between ranks when a
parameter is unused on one of them. Reductions are therefore launched in one fixed
order — layers in reverse natural order (``blocks.10`` before ``blocks.2``), the
usual backward order — and a layer only after every earlier one: a layer whose
gradients are complete waits for its predecessors. :meth:`Reduction.flush` launches
whatever is left, with zeros for parameters that got no gradient, so every rank
issues the same collectives in the same order. Whether a parameter had a gradient
on *any* rank is agreed by one small all-reduce of flags: a parameter no rank used
is skipped by the step, as on one process. The same all-reduce tells every rank
when all gradients of the step were held back by :meth:`Reduction.no_sync`, a step
that would otherwise silently move nothing.

A tensor-parallel DTensor gradient (owner mode over ``dp × tp``) travels as its local
part, ``p.grad.to_local()``, and comes back as a DTensor with the placements it had
(:func:`~dmuon.optim.engine.owner_split.as_gradient`).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dmuon.comm import (
    CommStats,
    OwnerPlan,
    collective_timeout,
    current_timeout,
    reduce_to_owners,
    wait_work,
)
from dmuon.comm.averaging import DIVIDED_BEFORE_THE_SUM
from dmuon.comm.faults import settle, stream_waits
from dmuon.comm.flags import flag_device
from dmuon.comm.process_groups import group_size, twin_groups
from dmuon.optim.engine.layer_record import OwnerLayer
from dmuon.optim.engine.owner_split import as_gradient
from dmuon.optim.engine.params import is_dtensor, unnarrowed_norms
from dmuon.optim.engine.publication import Publication
from dmuon.optim.engine.taken_gradients import KeptGradients, TakenGradients
from dmuon.optim.engine.tensor_split import laid_out_as, mark_relaid
from dmuon.optim.matrix_split import local_tensor

if TYPE_CHECKING:
    from dmuon.optim.engine.expert_replicas import ExpertReplicas

__all__ = ["Reduction", "UnsyncedGradientsError", "in_reentrant_backward"]

# the frame a custom autograd Function's backward runs under (torch.autograd.function)
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__


def in_reentrant_backward() -> bool:
    """Whether the caller runs inside a *reentrant* backward: one that the backward of a
    custom autograd Function started while the outer backward goes on.

    ``torch.utils.checkpoint(..., use_reentrant=True)`` (Hugging Face's
    ``gradient_checkpointing_enable()`` default) runs one per checkpointed segment. Its
    gradients are accumulated into ``p.grad`` when that segment's backward ends, not when
    the outer one does: a module called in two segments (ALBERT's one layer, run N
    times) gets two post-accumulate-grad hooks a step, so a layer complete after the first
    may still receive more. The engine runs a reentrant backward on the thread of the
    Function's backward, so that backward's Python frame is below the caller's.

    Examples:
        >>> in_reentrant_backward()
        False
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False


class UnsyncedGradientsError(RuntimeError):
    """A step found only gradients that ``no_sync()`` kept from being reduced.

    Raised on every rank (the ranks agree on it in the step's flag all-reduce):
    stepping would move no dedicated or all-reduced parameter. The locally accumulated
    gradients are kept: one more backward outside ``no_sync()`` and ``step()`` go on.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> from dmuon.optim import OwnerExchange, UnsyncedGradientsError
        >>> w = torch.nn.Parameter(torch.ones(4, 4))
        >>> item = MatrixItem("blocks.0.w", (4, 4), layer="blocks.0")
        >>> ex = OwnerExchange([(item, w)], plan=plan_owners([item], 1))
        >>> w.grad = torch.ones(4, 4)
        >>> with ex.reduction.no_sync():
        ...     ex.reduction.grad_ready(w)
        >>> try:
        ...     ex.reduction.flush()
        ... except UnsyncedGradientsError as err:
        ...     print(str(err)[:50])
        every gradient of this step was accumulated inside
    """


class Reduction:
    """The reduction side of owner mode: each layer's gradients to their owners.

    :class:`~dmuon.optim.engine.OwnerExchange` builds one and holds it as
    :attr:`OwnerExchange.reduction`, next to its :class:`Publication`; both share the
    same :class:`~dmuon.optim.engine.layer_record.OwnerLayer` records.

    Args:
        layers: the layer records, in forward order (their reduce and all-reduce
            buckets built).
        params: every dedicated and replicated parameter by name.
        layer_of: each of those names' layer key.
        plan: the owner plan of the dedicated parameters.
        group: the plan's process group (HSDP: the shard group); ``None``: the world.
        replicate_group: HSDP only, this rank's replicate group.
        stats: where the bytes are recorded.
        publication: the publication side; its broadcasts finish before a step's
            first reduction (ZeRO-2-like), so the two never interleave on a group.
        reduce_op: ``"avg"`` (the mean over the ranks) or ``"sum"``; see
            :class:`~dmuon.optim.engine.OwnerExchange`.
        free_local_grads: set each dedicated or all-reduced parameter's ``p.grad`` to
            ``None`` once it is copied into its bucket (see
            :class:`~dmuon.optim.engine.OwnerExchange`).

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> from dmuon.optim import OwnerExchange
        >>> w = torch.nn.Parameter(torch.ones(4, 4))
        >>> item = MatrixItem("blocks.0.w", (4, 4), layer="blocks.0")
        >>> ex = OwnerExchange([(item, w)], plan=plan_owners([item], 1))
        >>> w.grad = torch.ones(4, 4)
        >>> ex.reduction.grad_ready(w)
        >>> ex.reduction.wait_all_reduced()
        >>> w.grad.sum().item()
        16.0
    """

    def __init__(
        self,
        layers: Sequence[OwnerLayer],
        params: Mapping[str, torch.Tensor],
        layer_of: Mapping[str, str],
        plan: OwnerPlan,
        *,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        stats: CommStats,
        publication: Publication,
        reduce_op: str = "avg",
        free_local_grads: bool = False,
    ) -> None:
        self.layers = list(layers)
        self.reduce_op = reduce_op
        self.free_local_grads = free_local_grads
        # by its key, and a pack of small layers by each of its layers' keys too
        self.by_key = {k: layer for layer in self.layers for k in (layer.key, *layer.members)}
        self.params = params
        self.layer_of = layer_of
        self.plan = plan
        self.group = group
        self.replicate_group = replicate_group
        self.stats = stats
        self.publication = publication
        self.name_by_id = {id(p): name for name, p in params.items()}
        # each parameter's dtype and device when dedicated: its buckets' (a cast or move of
        # the model after dedicate() is refused by name as its first gradient arrives)
        self.placed = {name: (p.dtype, p.device) for name, p in params.items()}
        self.sync = True
        self.sync_condition: Callable[[], bool] | None = None
        self.present: set[str] = set()
        self.held_back = 0
        # gradients accumulated without a reduction this step (no_sync, or a sync
        # condition that said no): present at the step even if the last micro-batch,
        # which reduces, gives them nothing more
        self.accumulated: set[str] = set()
        self.global_present: dict[str, bool] = {}
        self.next_launch = 0
        self.flushed = False
        self.reduce_order = list(reversed(self.layers))
        # the placements of each DTensor gradient as it arrived (Partial stays Partial)
        self.grad_placements: dict[str, tuple[object, ...]] = {}
        # fixed for the exchange's life, so not asked again per gradient and step
        self.size = group_size(group)
        self.flag_device = flag_device(group)  # where the presence flags travel
        self.groups = [group] if replicate_group is None else [group, replicate_group]
        self.sizes = [group_size(g) for g in self.groups]
        # The presence flags travel on twins of the groups (the same ranks, communicators
        # of their own). A rank that did not use a layer launches it, and every layer
        # after it in the reduction order, only at the flush, after the flags; a rank that
        # used every layer launched them all in backward, before the flags. On the
        # reductions' own group the two orders would meet the flags' all-reduce against a
        # reduction, and both ranks would wait until the step's deadline.
        self.flag_groups = [
            twin_groups([g], purpose="presence")[0] if size > 1 else g
            for g, size in zip(self.groups, self.sizes, strict=True)
        ]
        self.split = frozenset(name for name, p in params.items() if is_dtensor(p))
        # the layers whose launch sums its gradients (finite_at_launch), with their
        # parameters by id: not under free_local_grads (there each gradient has its own
        # norm, released_norms), nor a layer with a tensor-parallel shard
        self.ids_of = {
            layer.key: frozenset(id(params[n]) for n in names)
            for layer in self.layers
            if not free_local_grads
            and self.split.isdisjoint(names := layer.dedicated + layer.replicated)
        }
        # each gradient copied into a bucket, as it was then: a change after that would not
        # reach the owner
        self.taken = TakenGradients()
        # the reduced gradients a step leaves on their owner, and those it reduced now
        self.kept = KeptGradients()
        self.reduced_views: dict[str, torch.Tensor] = {}
        # fixed for the exchange's life, so not sorted per step: the flags' order
        self.flag_names = sorted(params)
        # free_local_grads: each launched layer's gradients by name, with their fp32 max norms
        # taken at the copy, before the launch set them to None: the only proof left that
        # the released gradients were finite (finite_at_launch, released_nonfinite)
        self.released_norms: dict[str, tuple[list[str], torch.Tensor]] = {}
        # the expert stacks stepped in place whose gradients are summed among their
        # replicas as backward produces them (attach_experts, expert_grad_ready)
        self.experts: ExpertReplicas | None = None
        # ZeRO-3-like: a layer's reduce buckets exist only from its launch until its
        # reduction is waited on (OwnerLayer.close_reduce_buckets), none between steps
        self.transient_buckets = publication.reshard_after_forward
        if self.transient_buckets:
            for layer in self.layers:
                layer.close_reduce_buckets()
        # the last graph task a gradient arrived in, and whether it is a reentrant one
        # (in_reentrant_backward: the stack walked once per graph task, not per gradient)
        self.graph_task: tuple[int, bool] = (-1, False)

    def _in_reentrant_backward(self) -> bool:
        """:func:`in_reentrant_backward`, read once per autograd graph task."""
        task = torch._C._current_graph_task_id()
        if task < 0:
            return False  # not called from a backward (a direct grad_ready)
        if self.graph_task[0] != task:
            self.graph_task = (task, in_reentrant_backward())
        return self.graph_task[1]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the reductions inside the block: gradients accumulate locally.

        Use it for every micro-batch of a gradient-accumulation step but the last.
        """
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def set_sync_condition(self, condition: Callable[[], bool] | None) -> None:
        """Reduce a backward's gradients only while ``condition()`` is true (``None``: always).

        For training loops that decide per micro-batch, when the backward runs, whether
        it ends a gradient-accumulation step (DeepSpeed's
        ``engine.is_gradient_accumulation_boundary()``). It is asked as each gradient
        arrives, so it must not change during a backward; it adds to :meth:`no_sync`,
        which still keeps every reduction back inside its block.
        """
        if condition is not None and not callable(condition):
            raise TypeError(f"condition must be callable or None, got {type(condition).__name__}")
        self.sync_condition = condition

    def syncing(self) -> bool:
        """Whether a gradient arriving now is reduced: outside :meth:`no_sync` and, with a
        sync condition (:meth:`set_sync_condition`), while it holds."""
        return self.sync and (self.sync_condition is None or self.sync_condition())

    def attach_experts(self, experts: ExpertReplicas | None) -> ExpertReplicas | None:
        """Let :meth:`expert_grad_ready` sum the gradients of ``experts``' stacks into their
        owners among the replicas as backward produces them. The optimizer's engine
        attaches its own (``OwnerEngine.bind``) and steps the one this returns: the one
        attached already when it holds the same stacks (every optimizer built over this
        dedication shares it, so a second one, even unused, takes nothing from the
        first), else ``experts``, which replaces it (``None``: no stack is summed in
        backward; an engine's step then launches the reductions itself). The publication
        side holds the same (:attr:`Publication.experts`): the next forward waits for their
        broadcasts back."""
        if experts is not None and self.experts is not None and self.experts.same_stacks(experts):
            return self.experts
        self.publication.wait_experts()  # the replaced one's last broadcasts (deadline)
        self.experts = self.publication.experts = experts
        return experts

    def expert_grad_ready(self, p: torch.Tensor) -> None:
        """A gradient of expert stack ``p`` has been accumulated (a post-accumulate-grad
        hook, installed by :func:`~dmuon.integrations.install_hooks` on the stacks of
        :attr:`OwnerExchange.experts`): launch its bucket's reduction when the bucket is
        complete, outside :meth:`no_sync` and while the sync condition holds
        (:meth:`~dmuon.optim.engine.expert_replicas.ExpertReplicas.grad_ready`)."""
        if self.experts is not None:
            self.experts.grad_ready(p, self.syncing())

    def grad_ready(self, p: torch.Tensor) -> None:
        """A gradient of ``p`` has been accumulated (call from a post-accumulate hook)."""
        name = self.name_by_id.get(id(p))
        if name is not None and self.publication.unwaited(key := self.layer_of[name]):
            raise RuntimeError(
                f"parameter {name!r} got a gradient from a forward that ran past the wait "
                f"for the weights of its layer {self.by_key[key].key!r}: the forward "
                "pre-hook of the layer's module (below a module that a forward never "
                "calls, each first module that one does) waits for them after each "
                "step, and it was not called since (a forward run past its hooks, "
                "module.forward(x) for module(x), or the weight read outside its layer), "
                "so the weights were read before or while they arrived from their owners. "
                "Call the layer as a module, pass layer_of= naming modules the forward "
                "calls, or call ded.wait() on every rank after opt.step()"
            )
        if name is not None and (p.dtype, p.device) != self.placed[name]:
            dtype, device = self.placed[name]
            raise RuntimeError(
                f"parameter {name!r} is {p.dtype} on {p.device} but was dedicated as {dtype} "
                f"on {device}: the model was cast or moved after dedicate(), and its "
                "reduction buckets keep the dtype and device it had then. Call model.to(...) "
                "before dedicate() (and build DMuon after it)"
            )
        held = not self.sync  # no_sync(); the sync condition is not asked then
        if held or (self.sync_condition is not None and not self.sync_condition()):
            if name is not None:
                self.held_back += held  # counted for UnsyncedGradientsError: no_sync's only
                self.accumulated.add(name)
            return
        if name is None:
            return
        layer = self.by_key[self.layer_of[name]]
        if layer.launched:
            raise RuntimeError(
                f"a second gradient of {name!r} arrived after its layer {layer.key!r} was "
                "reduced; call backward once per optimizer step, or run the earlier "
                "micro-batches inside no_sync(); to drop a batch after its backward, call "
                "the optimizer's zero_grad() (DMuon's: it finishes and discards the step's "
                "reductions)"
            )
        if not self.present and not self.publication.reshard_after_forward:
            # publications finish before this step's reductions (the experts' are their
            # layers' to wait for: a wait here would hide a forward that read them early)
            self.publication.wait_all_layers()
        self.present.add(name)
        layer.ready.add(name)
        if self._in_reentrant_backward():
            # Inside a reentrant backward (checkpointing with use_reentrant=True) a
            # complete layer may still get gradients: a module reused in another
            # checkpointed segment gets one more per use, which one process sums. Its launch
            # (and every later one: the order is fixed) waits for a gradient arriving in the
            # outer backward, or for the flush; the same order on every rank either way.
            return
        while self.next_launch < len(self.reduce_order):
            nxt = self.reduce_order[self.next_launch]
            if len(nxt.ready) < nxt.expected:
                break
            self._launch(nxt)

    def flush(
        self, agreement: Callable[[frozenset[int]], torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Launch every reduction not launched yet (zeros for missing gradients).

        Args:
            agreement: the step's guards, to carry in the flags' all-reduce
                (:func:`~dmuon.optim.engine.guards.agree_step`): called once, before it,
                with the ids of the parameters whose local gradient its non-finite check
                need not read — those a launch in backward proved finite
                (:meth:`finite_at_launch`) — it gives this rank's ``int64``
                agreement slots, which are summed over the same groups as the flags,
                appended to them — one all-reduce a step, not two. Under
                ``free_local_grads`` a gradient a launch in backward released and found
                NaN or Inf in is, while ``agreement`` runs, ``p.grad`` again as a stand-in
                of its launch's norm (:meth:`released_nonfinite`), so that the check finds
                and names it on this rank and every rank raises or skips; the gradients
                of the layers the flush launches are still there to be read. Not called when the
                step was flushed already (a clip or ``unscale_`` finished the reductions
                before ``step()``).

        Returns:
            ``agreement``'s slots summed over the groups (a host tensor: the flags were
            read once), or ``None`` when nothing was carried (no ``agreement``, or
            flushed already).

        Raises:
            UnsyncedGradientsError: on every rank, when no rank reduced a gradient this
                step but some rank accumulated gradients inside :meth:`no_sync`.
        """
        if self.flushed:
            return None
        if not self.publication.reshard_after_forward:
            self.publication.wait_all_published()
        # The flags before the launches below: when no rank synchronised a gradient,
        # nothing was launched anywhere, and nothing is (the accumulated gradients stay
        # where they are, even under free_local_grads, for the backward that follows).
        # a reduced gradient the last step left, added to or stepped again: found before
        # the agreement is read (StaleGradientError), for the layers not launched yet
        for name in self.kept.pending():
            self.kept.check(name, self.params, self.present)
        names = self.flag_names  # by name: one order on every rank
        # a gradient counts if it arrived in this step's backward or is there: accumulated
        # (and not dropped by a model.zero_grad() since), or held without a backward's
        # touching it — zeros kept by zero_grad(set_to_none=False) for a parameter no
        # backward used this step, which one process steps (momentum, weight decay)
        arrived = [n in self.present or self.params[n].grad is not None for n in names]
        local = [*map(int, arrived), self.held_back, int(bool(self.present))]
        if agreement is None:
            flags = torch.tensor(local, dtype=torch.int32, device=self.flag_device)
        else:
            # int64: the agreement's slots carry the step number
            # the released gradients whose launch found a NaN/Inf stand in for the check
            # (read inside agreement()), named on this rank as the others would be
            vouched, nonfinite = self._launch_proofs()  # one read of them all
            stand_ins = self._stand_ins(nonfinite)
            try:
                slots = agreement(vouched)
            finally:
                for p in stand_ins:
                    p.grad = None  # released, as the launch left it
            slots = slots.to(self.flag_device)
            flags = torch.cat([torch.tensor(local, dtype=torch.int64, device=slots.device), slots])
        for g, size in zip(self.flag_groups, self.sizes, strict=True):
            if size > 1:
                wait_work(
                    dist.all_reduce(flags, group=g, async_op=True),
                    "all-reduce of gradient-presence flags"
                    + ("" if agreement is None else " and the step's agreement"),
                    g,
                )
                self.stats.record_collective(
                    "presence_flags", "all_reduce", nbytes=flags.nbytes, world_size=size
                )
        # the deadline of the collectives left to the stream (NCCL), checked before the
        # host read; waited for when the flags' own all-reduce was (the read waits anyway)
        streamed = (g for g, size in zip(self.flag_groups, self.sizes, strict=True) if size > 1)
        settle(wait=any(stream_waits(g, flags.device) for g in streamed))
        summed = flags.tolist()
        *present, held_back, synced = summed[: len(names) + 2]
        if held_back and not synced:
            if self.publication.reshard_after_forward:
                self.publication.release_all()  # what backward materialised, as a step would
            self.held_back = 0  # the rest of the step's bookkeeping stays for the next backward
            raise UnsyncedGradientsError(
                f"every gradient of this step was accumulated inside no_sync() ({held_back} "
                "gradient(s) over the ranks) and none was synchronised (reduced to its owner "
                "or all-reduced), so step() would move no parameter; run the last "
                "micro-batch of each accumulation step outside no_sync()"
            )
        self.global_present = dict(zip(names, map(bool, present), strict=True))
        self.flushed = True
        while self.next_launch < len(self.reduce_order):
            self._launch(self.reduce_order[self.next_launch])
        if agreement is None:
            return None
        # the agreement's slots from the host read above, on the host: its reader need
        # not read the device again (on CUDA a second sync, after the launches above)
        return torch.tensor(summed[len(names) + 2 :], dtype=torch.int64)

    def carries_agreement(self) -> bool:
        """Whether :meth:`flush` would all-reduce its flags now (not flushed yet, a group
        of more than one rank), so that the step's agreement may ride along."""
        return not self.flushed and any(size > 1 for size in self.sizes)

    def _launch(self, layer: OwnerLayer) -> None:
        # the layer's gradients into their bucket slots: one foreach copy (and one zeroing
        # for the missing ones) per layer, not a copy per gradient
        slots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        taken: list[str] = []  # the names of slots' gradients
        missing: list[torch.Tensor] = []
        if self.transient_buckets:
            layer.open_reduce_buckets()
        buckets = layer.reduce_buckets + layer.allreduce_buckets
        for name in layer.dedicated:  # before a copy (or free_local_grads) can hide it
            self.kept.check(name, self.params, self.present)
        for b in buckets:
            for name in b.names:
                g = self.params[name].grad
                view = b.view(name)
                if g is None:
                    missing.append(view)
                    continue
                if g.is_sparse:  # refused on every rank by the step's agreement (agree_step):
                    g = g.to_dense()  # sent dense meanwhile, so the collectives pair up
                if name in self.split:
                    # a Replicate() gradient of a shard is cut to it (pending sums stay);
                    # a collective waits under the step's deadline, the hooks' outside it
                    with collective_timeout(current_timeout() or self.publication.timeout):
                        settled = laid_out_as(
                            g, self.params[name], partial=False, name=name, stats=self.stats
                        )
                    if settled is not g:
                        g = settled
                        mark_relaid(self.params[name])
                    self.grad_placements[name] = tuple(g.placements)  # type: ignore[attr-defined]
                    g = local_tensor(g)
                slots.append(view)
                grads.append(g.reshape(view.shape))
                taken.append(name)
        if missing:
            torch._foreach_zero_(missing)
        if slots:
            torch._foreach_copy_(slots, grads)
            if layer.key in self.ids_of:
                # one sum per bucket, before the collectives write the buckets: the step's
                # non-finite check reads it instead of each gradient (finite_at_launch)
                sums = [b.buffer.sum(dtype=torch.float32) for b in buckets]
                layer.launch_sum = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
            elif self.free_local_grads:
                # the proof the released gradients leave (finite_at_launch): one norm per
                # gradient, to name the bad one, in fp32 (an fp16 norm overflows at 65504).
                # the max norm: a NaN or Inf entry makes it NaN or Inf, and finite entries
                # cannot overflow it (an ℓ1 norm of entries near 3e38 did: a finite gradient
                # refused); torch._foreach_norm takes them all in one fused launch on a GPU
                # (a float64 gradient's in float64: the norm refuses to narrow it)
                norms = unnarrowed_norms(slots, math.inf)
                self.released_norms[layer.key] = (taken, torch.stack(norms))
        if self.free_local_grads:  # once copied: a failed copy leaves the gradients
            for name in layer.dedicated + layer.replicated:  # the buckets' names
                self.params[name].grad = None
        if layer.reduce_buckets:
            layer.reduce_handle = reduce_to_owners(
                layer.reduce_buckets,
                self.plan,
                group=self.group,
                replicate_group=self.replicate_group,
                stats=self.stats,
                op=self.reduce_op,
                checked=True,  # made by make_buckets from this plan (layer_record.py)
            )
        n = self.size
        for b in layer.allreduce_buckets:
            if n > 1:
                if self.reduce_op == "avg" and b.dtype in DIVIDED_BEFORE_THE_SUM:
                    b.buffer.div_(n)  # fp16: before the sum, which would overflow
                layer.allreduce_works.append(
                    dist.all_reduce(b.buffer, group=self.group, async_op=True)
                )
                self.stats.record_collective(
                    "all_reduce_replicated", "all_reduce", nbytes=b.nbytes, world_size=n
                )
        if not self.free_local_grads:
            # each gradient as it left, its version read once every copy and collective of
            # the layer is under way: after zero_grad(set_to_none=False) the gradients are
            # views of these very buckets and share their version counter
            for name in layer.dedicated + layer.replicated:
                self.taken.take(name, name, self.params[name])
        layer.launched = True
        self.next_launch += 1

    def wait_reduced(self, key: str) -> None:
        """Finish layer ``key``'s reductions and set its gradients (the key of a layer
        packed with others: its whole pack's).

        Afterwards the owner's ``p.grad`` is the averaged (``reduce_op="sum"``: summed)
        gradient (a view into the reduction buffer) for every parameter some rank had a
        gradient for; the other ranks' ``p.grad`` is ``None``. Replicated parameters get
        the average (sum) on every rank. Call :meth:`flush` first.
        """
        layer = self.by_key[key]
        if layer.reduced:
            return
        if not self.flushed:
            raise RuntimeError("flush() must run before the reductions are waited on")
        # before the wait: it writes the buckets (the owner's division, HSDP's second stage)
        self.taken.settle(layer.dedicated + layer.replicated)
        owned = layer.reduce_handle.wait() if layer.reduce_handle is not None else {}
        layer.launch_sum = None  # it spoke of the local gradients replaced below
        for k in (layer.key, *layer.members):
            self.released_norms.pop(k, None)
        for name in layer.dedicated:
            p = self.params[name]
            if name in owned and self.global_present[name]:
                p.grad = self.reduced_views[name] = self._gradient(name, owned[name])
            else:
                p.grad = None
        for w in layer.allreduce_works:
            wait_work(w, f"all-reduce of layer {key!r}'s replicated gradients", self.group)
        n = self.size
        for b in layer.allreduce_buckets:
            if n > 1 and self.reduce_op == "avg" and b.dtype not in DIVIDED_BEFORE_THE_SUM:
                b.buffer.div_(n)
            for name in b.names:
                p = self.params[name]
                p.grad = self._gradient(name, b.view(name)) if self.global_present[name] else None
        layer.reduce_handle, layer.allreduce_works, layer.reduced = None, [], True
        if self.transient_buckets:
            layer.close_reduce_buckets()  # the owner's p.grad views keep its own alive

    def changed_gradients(self) -> list[str]:
        """Parameters whose gradient was changed (in place, or replaced) after it was copied
        into its reduction bucket this step: the change would not reach the owner."""
        return self.taken.changed()

    def finite_at_launch(self) -> frozenset[int]:
        """The ids of the parameters whose local gradient is proven finite by its layer's
        launch: the sum of the gradients its launch copied into the buckets
        (:attr:`OwnerLayer.launch_sum`) is finite, and a NaN or Inf entry would make it NaN
        or Inf (finite entries whose sum overflows only leave them unproven).

        Valid until the layer's reductions are waited on (:meth:`wait_reduced` replaces
        the gradients); a gradient changed since its launch is refused by the step's
        agreement anyway (:meth:`changed_gradients`). One read of all the layers' sums: the
        step's non-finite check (:func:`~dmuon.optim.engine.guards.agree_step`) then reads
        only the gradients no launch has vouched for, instead of every gradient again.

        Under ``free_local_grads`` the launch sets the gradients it copies to ``None``:
        each one's own norm at the copy (``released_norms``) vouches for it when finite;
        one that is not is :meth:`released_nonfinite`'s, for the check to find.
        """
        return self._launch_proofs()[0]

    def released_nonfinite(self) -> dict[str, torch.Tensor]:
        """The parameters whose gradient a launch released (``free_local_grads``) with a
        NaN or Inf entry, by name: their
        norm at the copy (a 0-D fp32 tensor). No other record of them is left on this rank,
        so :meth:`flush` shows them to the step's non-finite check as stand-in gradients."""
        return self._launch_proofs()[1]

    def _launch_proofs(self) -> tuple[frozenset[int], dict[str, torch.Tensor]]:
        """:meth:`finite_at_launch` and :meth:`released_nonfinite`, from one read of every
        launch's sums and norms."""
        taken = [(layer, layer.launch_sum) for layer in self.layers]
        layers = [layer for layer, s in taken if s is not None]
        released = list(self.released_norms.values())
        if not layers and not released:
            return frozenset(), {}
        finite = torch.isfinite(
            torch.cat(
                [*(s.reshape(1) for _, s in taken if s is not None), *(n for _, n in released)]
            )
        ).tolist()
        ok_layers, ok_norms = finite[: len(layers)], finite[len(layers) :]
        ids = frozenset().union(
            *(self.ids_of[layer.key] for layer, ok in zip(layers, ok_layers, strict=True) if ok)
        )
        names = [name for ns, _ in released for name in ns]
        if all(ok_norms):
            return ids | {id(self.params[n]) for n in names}, {}
        norms = [n for _, layer_norms in released for n in layer_norms.unbind()]
        ids |= {id(self.params[n]) for n, ok in zip(names, ok_norms, strict=True) if ok}
        bad = {n: norms[i] for i, (n, ok) in enumerate(zip(names, ok_norms, strict=True)) if not ok}
        return ids, bad

    def _stand_ins(self, nonfinite: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Give each parameter of ``nonfinite`` (:meth:`released_nonfinite`) a stand-in
        gradient: its launch's norm (NaN or Inf), expanded to its shape without memory (for a
        tensor-parallel shard, a DTensor of its local part). Returns the parameters given
        one; :meth:`flush` sets their gradients back to ``None`` after the check."""
        given = []
        for name, norm in nonfinite.items():
            p = self.params[name]
            local = norm.to(dtype=p.dtype, device=p.device).expand(local_tensor(p).shape)
            p.grad = as_gradient(p, local)
            given.append(p)
        return given

    def _gradient(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``p.grad`` of parameter ``name`` from its reduced ``local`` part: a view shaped
        like ``p``, or for a tensor-parallel shard a DTensor (:func:`as_gradient`)."""
        p = self.params[name]
        if name in self.split:
            return as_gradient(p, local, self.grad_placements.get(name))
        # the buckets' views are shaped as their parameters already (FlatBucket.view):
        # no new view per parameter and step
        return local if local.shape == p.shape else local.view(p.shape)

    def started(self) -> bool:
        """Whether this step's reductions have begun on this rank: a gradient arrived
        (:meth:`grad_ready`) or :meth:`flush` ran, since the last :meth:`end_step`. Then a
        step, a skipped step or a discarded one has them to finish."""
        return bool(self.present) or self.flushed

    def wait_all_reduced(self) -> None:
        """:meth:`flush`, then :meth:`wait_reduced` for every layer in forward order."""
        self.flush()
        for layer in self.layers:
            self.wait_reduced(layer.key)

    def stale_gradients(self) -> list[str]:
        """Parameters whose ``p.grad`` was the averaged gradient the last step left on this
        owner, not zeroed since, at this step's launch (:class:`KeptGradients`)."""
        return self.kept.stale()

    def end_step(self) -> None:
        """Forget this step's bookkeeping (the engine calls it after publishing); the
        reduced gradients still in ``p.grad`` are kept in mind for the next step."""
        self.kept.clear()
        self.kept.leave({n: g for n, g in self.reduced_views.items() if self.params[n].grad is g})
        self.reduced_views.clear()
        for layer in self.layers:
            layer.ready.clear()
            layer.launched = layer.reduced = False
            layer.launch_sum = None
        self.released_norms.clear()
        self.present.clear()
        self.accumulated.clear()
        self.taken.clear()
        self.held_back = 0
        self.next_launch = 0
        self.flushed = False
        self.publication.end_step()
