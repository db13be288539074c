"""Owner-mode traffic of one model: gradients reduced to owners, results published back.

This is the communication of DMuon's owner-centric execution (Chen et al., *Efficient
Distributed Muon Training with Near-Adam Overhead*, 2026). Every *dedicated* parameter
has one owner rank from an :class:`~dmuon.comm.OwnerPlan`:

* its gradient is reduced (averaged) to the owner only, layer by layer, as soon as
  backward has produced a layer's gradients (:meth:`OwnerExchange.grad_ready`,
  called from a post-accumulate-grad hook), so the reductions overlap the rest of
  backward;
* only the owner steps it; the other ranks hold no gradient and no momentum for it;
* the new weight is broadcast from the owner (:meth:`OwnerExchange.publish`), one
  collective per owner per layer, started as soon as that layer's step is done and
  waited only where the weight is next needed (:meth:`OwnerExchange.wait_published`,
  from the layer's forward pre-hook).

Per step and rank that is ``(N−1)/N·P`` bytes for the reductions and as much for
the broadcasts: ``2(N−1)/N·P``, one ring all-reduce, with each matrix orthogonalised
once. *Replicated* parameters (the scalar parameters when this replaces DDP) are
all-reduced in the same layer buckets instead.

**Hang freedom.** Hooks fire in backward order, which differs between ranks when a
parameter is unused on one of them. Reductions are therefore launched in one fixed
order — layers in reverse natural order (``blocks.10`` before ``blocks.2``), the
usual backward order — and a layer only after every earlier one: a layer whose
gradients are complete waits for its predecessors. :meth:`OwnerExchange.flush`
launches whatever is left, with zeros for parameters that got no gradient, so every
rank issues the same collectives in the same order. Whether a parameter had a
gradient on *any* rank is agreed by one small all-reduce of flags: a parameter no
rank used is skipped by the step, as on one process.

The publication buckets *are* the weights: every dedicated parameter's ``.data`` is
a view into its layer's broadcast buffer, so the owner's in-place step writes
straight into what it broadcasts and the other ranks receive straight into their
parameters (no packing copies). Move the model to its device before dedicating it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dmuon.comm import (
    CommStats,
    FlatBucket,
    MatrixItem,
    OwnerPlan,
    default_stats,
    make_buckets,
    reduce_to_owners,
    wait_work,
)
from dmuon.comm.groups import group_rank, group_size
from dmuon.comm.owner_plan import natural_key
from dmuon.optim.engine.consistency import check_model_consistency
from dmuon.optim.engine.layer_record import OwnerLayer
from dmuon.optim.engine.publication import Publication

__all__ = ["OwnerExchange", "exchange_of"]

# id(parameter) → (weak reference to it, its exchange). Keyed by id: tensors compare
# elementwise, so they cannot be dictionary keys by value.
_REGISTRY: dict[int, tuple[weakref.ref[torch.Tensor], OwnerExchange]] = {}


def exchange_of(p: torch.Tensor) -> OwnerExchange | None:
    """The :class:`OwnerExchange` a parameter was dedicated to (``None``: not dedicated)."""
    entry = _REGISTRY.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]


def _register(p: torch.Tensor, exchange: OwnerExchange) -> None:
    key = id(p)
    _REGISTRY[key] = (weakref.ref(p, lambda _: _REGISTRY.pop(key, None)), exchange)


class OwnerExchange:
    """Reduce-to-owner and broadcast-from-owner traffic for a set of dedicated parameters.

    Integrations build one (``dmuon.integrations.fsdp.dedicate``,
    ``dmuon.integrations.ddp.dedicate``) and install the hooks that call it;
    :class:`~dmuon.optim.DMuon` finds it from the parameters and runs the owner
    step with it.

    Args:
        dedicated: ``(item, parameter)`` pairs: what is planned for each dedicated
            parameter (name, shape as orthogonalised, dtype, layer) and the parameter.
        replicated: ``(name, layer, parameter)`` triples of parameters that every rank
            steps, whose gradients are all-reduced (DDP replacement's scalars).
        plan: the owner plan of the dedicated items (the same on every rank).
        group: the process group of the plan's ranks (HSDP: the shard group);
            ``None``: the world.
        replicate_group: HSDP only, this rank's replicate group.
        stats: where the bytes are recorded; default :func:`dmuon.comm.default_stats`.
        reshard_after_forward: ZeRO-3-like: ranks keep only the weights they own and
            materialise the others around each layer's forward and backward (see
            :mod:`dmuon.optim.engine.publication`); 1-D groups only.

    Raises:
        ValueError: a parameter dedicated twice, a plan that does not cover the items,
            or replicated parameters under HSDP.
        dmuon.optim.engine.ModelMismatchError: the ranks' models differ (on every
            rank, naming the parameter, before any other collective).

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> w = torch.nn.Parameter(torch.ones(4, 4))
        >>> item = MatrixItem("blocks.0.w", (4, 4), layer="blocks.0")
        >>> ex = OwnerExchange([(item, w)], plan=plan_owners([item], 1))
        >>> ex.owned_names
        ('blocks.0.w',)
    """

    def __init__(
        self,
        dedicated: Sequence[tuple[MatrixItem, torch.Tensor]],
        *,
        plan: OwnerPlan,
        replicated: Sequence[tuple[str, str, torch.Tensor]] = (),
        group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        reshard_after_forward: bool = False,
    ) -> None:
        self.plan = plan
        self.group = group
        self.replicate_group = replicate_group
        self.stats = stats if stats is not None else default_stats()
        S = group_size(group)
        R = group_size(replicate_group) if replicate_group is not None else 1
        self.world_size = R * S
        self.rank = (group_rank(replicate_group) * S if replicate_group is not None else 0) + (
            group_rank(group)
        )
        if reshard_after_forward and replicate_group is not None:
            raise ValueError(
                "reshard_after_forward (ZeRO-3-like) is supported on a 1-D group; under HSDP "
                "keep the dedicated weights resident"
            )
        self.reshard_after_forward = reshard_after_forward
        if replicated and replicate_group is not None:
            raise ValueError(
                "replicated (all-reduced) parameters are for the DDP replacement on a 1-D "
                "group; under HSDP leave the scalar parameters to FSDP2"
            )
        self._params: dict[str, torch.Tensor] = {}
        self._items: dict[str, MatrixItem] = {}
        self._layer_of: dict[str, str] = {}
        layers: dict[str, OwnerLayer] = {}
        for item, p in dedicated:
            if item.name in self._params or exchange_of(p) is not None:
                raise ValueError(f"parameter {item.name!r} is dedicated twice")
            if item.name not in plan:
                raise ValueError(f"the plan has no item {item.name!r}; plan every dedicated item")
            self._params[item.name], self._items[item.name] = p, item
            key = item.layer if item.layer is not None else item.name
            self._layer_of[item.name] = key
            layers.setdefault(key, OwnerLayer(key)).dedicated.append(item.name)
        if len(self._items) != len(plan):
            raise ValueError(f"the plan has {len(plan)} items for {len(self._items)} parameters")
        for name, key, p in replicated:
            if name in self._params:
                raise ValueError(f"parameter {name!r} is both dedicated and replicated")
            self._params[name] = p
            self._layer_of[name] = key
            layers.setdefault(key, OwnerLayer(key)).replicated.append(name)
        self.layers = [layers[k] for k in sorted(layers, key=natural_key)]
        self._by_key = {layer.key: layer for layer in self.layers}
        # One model check before anything else travels (no-op on one rank).
        check_model_consistency(_with_replicated(plan, replicated), group, replicate_group)
        self._name_by_id = {id(p): name for name, p in self._params.items()}
        for layer in self.layers:
            layer.dedicated.sort(key=plan.index)
            names = [*layer.dedicated, *layer.replicated]
            device = self._params[names[0]].device
            layer.reduce_buckets = make_buckets(plan, names=layer.dedicated, device=device)
            layer.publish_buckets = make_buckets(plan, names=layer.dedicated, device=device)
            by_dtype: dict[torch.dtype, list[str]] = {}
            for name in layer.replicated:
                by_dtype.setdefault(self._params[name].dtype, []).append(name)
            layer.allreduce_buckets = [
                FlatBucket(
                    [(n, tuple(self._params[n].shape)) for n in names], dtype=dt, device=device
                )
                for dt, names in by_dtype.items()
            ]
        for _, p in dedicated:
            _register(p, self)
        self.publication = Publication(
            self.layers,
            self._params,
            plan,
            rank=self.rank,
            world_size=self.world_size,
            group=group,
            replicate_group=replicate_group,
            stats=self.stats,
            reshard_after_forward=reshard_after_forward,
        )
        self._sync = True
        self._sync_condition: Callable[[], bool] | None = None
        self._present: set[str] = set()
        self._global_present: dict[str, bool] = {}
        self._next_launch = 0
        self._flushed = False
        self._reduce_order = list(reversed(self.layers))
        self.publication.synchronize_parameters()
        self.publication.release_all()

    # ------------------------------------------------------------------ lookups

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the dedicated parameters, in the plan's canonical order."""
        return self.plan.names

    @property
    def params(self) -> list[torch.Tensor]:
        """The dedicated parameters (pass them to ``fully_shard(..., ignored_params=...)``)."""
        return [self._params[n] for n in self.plan.names]

    @property
    def replicated_names(self) -> tuple[str, ...]:
        """Names of the all-reduced parameters, layer by layer."""
        return tuple(n for layer in self.layers for n in layer.replicated)

    def param(self, name: str) -> torch.Tensor:
        """The dedicated or replicated parameter called ``name``."""
        return self._params[name]

    @property
    def owned_names(self) -> tuple[str, ...]:
        """Names of the parameters this rank owns."""
        return self.plan.names_of(self.rank)

    def owner(self, name: str) -> int:
        """The owner of dedicated parameter ``name`` (HSDP: its slot ``i·S + j``)."""
        return self.plan.owner(name)

    def name_of(self, p: torch.Tensor) -> str | None:
        """The name ``p`` was dedicated or replicated under (``None``: neither)."""
        return self._name_by_id.get(id(p))

    def layer_of(self, name: str) -> str:
        """The layer key of the dedicated or replicated parameter called ``name``."""
        return self._layer_of[name]

    def layer_keys(self) -> list[str]:
        """Layer keys, in natural (forward) order."""
        return [layer.key for layer in self.layers]

    def layer_names(self, key: str) -> list[str]:
        """The dedicated and replicated parameter names of layer ``key``."""
        layer = self._by_key[key]
        return [*layer.dedicated, *layer.replicated]

    # --------------------------------------------------------------- reductions

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the reductions inside the block: gradients accumulate locally.

        Use it for every micro-batch of a gradient-accumulation step but the last.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

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
        self._sync_condition = condition

    def grad_ready(self, p: torch.Tensor) -> None:
        """A gradient of ``p`` has been accumulated (call from a post-accumulate hook)."""
        if not self._sync or (self._sync_condition is not None and not self._sync_condition()):
            return
        name = self._name_by_id.get(id(p))
        if name is None:
            return
        layer = self._by_key[self._layer_of[name]]
        if layer.launched:
            raise RuntimeError(
                f"a second gradient of {name!r} arrived after its layer {layer.key!r} was "
                "reduced; call backward once per optimizer step, or run the earlier "
                "micro-batches inside no_sync()"
            )
        if not self._present and not self.reshard_after_forward:
            # publications finish before this step's reductions
            self.publication.wait_all_published()
        self._present.add(name)
        layer.ready.add(name)
        while self._next_launch < len(self._reduce_order):
            nxt = self._reduce_order[self._next_launch]
            if len(nxt.ready) < nxt.expected:
                break
            self._launch(nxt)

    def flush(self) -> None:
        """Launch every reduction not launched yet (zeros for missing gradients)."""
        if self._flushed:
            return
        if not self.reshard_after_forward:
            self.publication.wait_all_published()
        while self._next_launch < len(self._reduce_order):
            self._launch(self._reduce_order[self._next_launch])
        names = sorted(self._params)  # by name: one order on every rank
        flags = torch.tensor([int(n in self._present) for n in names], dtype=torch.int32)
        groups = (
            [self.group] if self.replicate_group is None else [self.group, self.replicate_group]
        )
        for g in groups:
            if group_size(g) > 1:
                wait_work(
                    dist.all_reduce(flags, group=g, async_op=True),
                    "all-reduce of gradient-presence flags",
                    g,
                )
                self.stats.record_collective(
                    "presence_flags", "all_reduce", nbytes=flags.nbytes, world_size=group_size(g)
                )
        self._global_present = {n: bool(f) for n, f in zip(names, flags.tolist(), strict=True)}
        self._flushed = True

    def _launch(self, layer: OwnerLayer) -> None:
        for b in layer.reduce_buckets + layer.allreduce_buckets:
            for name in b.names:
                g = self._params[name].grad
                view = b.view(name)
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g.reshape(view.shape))
        if layer.reduce_buckets:
            layer.reduce_handle = reduce_to_owners(
                layer.reduce_buckets,
                self.plan,
                group=self.group,
                replicate_group=self.replicate_group,
                stats=self.stats,
            )
        n = group_size(self.group)
        for b in layer.allreduce_buckets:
            if n > 1:
                layer.allreduce_works.append(
                    dist.all_reduce(b.buffer, group=self.group, async_op=True)
                )
                self.stats.record_collective(
                    "all_reduce_replicated", "all_reduce", nbytes=b.nbytes, world_size=n
                )
        layer.launched = True
        self._next_launch += 1

    def wait_reduced(self, key: str) -> None:
        """Finish layer ``key``'s reductions and set its gradients.

        Afterwards the owner's ``p.grad`` is the averaged gradient (a view into the
        reduction buffer) for every parameter some rank had a gradient for; the other
        ranks' ``p.grad`` is ``None``. Replicated parameters get the average on
        every rank. Call :meth:`flush` first.
        """
        layer = self._by_key[key]
        if layer.reduced:
            return
        if not self._flushed:
            raise RuntimeError("flush() must run before the reductions are waited on")
        owned = layer.reduce_handle.wait() if layer.reduce_handle is not None else {}
        for name in layer.dedicated:
            p = self._params[name]
            if name in owned and self._global_present[name]:
                p.grad = owned[name].view(p.shape)
            else:
                p.grad = None
        for w in layer.allreduce_works:
            wait_work(w, f"all-reduce of layer {key!r}'s replicated gradients", self.group)
        n = group_size(self.group)
        for b in layer.allreduce_buckets:
            if n > 1:
                b.buffer.div_(n)
            for name in b.names:
                p = self._params[name]
                p.grad = b.view(name).view(p.shape) if self._global_present[name] else None
        layer.reduce_handle, layer.allreduce_works, layer.reduced = None, [], True

    def wait_all_reduced(self) -> None:
        """:meth:`flush`, then :meth:`wait_reduced` for every layer in forward order."""
        self.flush()
        for layer in self.layers:
            self.wait_reduced(layer.key)

    def end_step(self) -> None:
        """Forget this step's bookkeeping (the engine calls it after publishing)."""
        for layer in self.layers:
            layer.ready.clear()
            layer.launched = layer.reduced = False
        self._present.clear()
        self._next_launch = 0
        self._flushed = False
        self.publication.end_step()

    # ------------------------------------------------------------- publication

    @property
    def timeout(self) -> float | None:
        """Seconds a wait for published weights may take (``None``: the group's timeout);
        :class:`~dmuon.optim.DMuon` sets it from its ``timeout=``."""
        return self.publication.timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self.publication.timeout = seconds

    @property
    def published_step(self) -> int:
        """The DMuon step whose weights are in flight (named in timeout messages)."""
        return self.publication.published_step

    @published_step.setter
    def published_step(self, number: int) -> None:
        self.publication.published_step = number

    def publish(self, key: str) -> None:
        """See :meth:`Publication.publish`."""
        self.publication.publish(key)

    def wait_published(self, key: str) -> None:
        """See :meth:`Publication.wait_published` (the forward pre-hook calls this)."""
        self.publication.wait_published(key)

    def wait_all_published(self) -> None:
        """See :meth:`Publication.wait_all_published`."""
        self.publication.wait_all_published()

    def pending_publications(self) -> list[str]:
        """See :meth:`Publication.pending_publications`."""
        return self.publication.pending_publications()

    def materialize(self, key: str, wait: bool = True) -> None:
        """See :meth:`Publication.materialize`."""
        self.publication.materialize(key, wait)

    def release(self, key: str) -> None:
        """See :meth:`Publication.release`."""
        self.publication.release(key)

    def release_all(self) -> None:
        """See :meth:`Publication.release_all`."""
        self.publication.release_all()

    def released_names(self) -> list[str]:
        """See :meth:`Publication.released_names`."""
        return self.publication.released_names()

    def forward_enter(self, key: str) -> None:
        """See :meth:`Publication.forward_enter` (forward pre-hook)."""
        self.publication.forward_enter(key)

    def forward_exit(self, key: str) -> None:
        """See :meth:`Publication.forward_exit` (forward post-hook)."""
        self.publication.forward_exit(key)

    def backward_enter(self, key: str) -> None:
        """See :meth:`Publication.backward_enter` (backward pre-hook)."""
        self.publication.backward_enter(key)

    def synchronize_parameters(self) -> None:
        """See :meth:`Publication.synchronize_parameters`."""
        self.publication.synchronize_parameters()

    def describe(self) -> str:
        """One line per layer: its parameters and owners."""
        lines = [repr(self.plan)]
        for layer in self.layers:
            owners = ", ".join(f"{n}→{self.plan.owner(n)}" for n in layer.dedicated)
            extra = f"; all-reduced: {', '.join(layer.replicated)}" if layer.replicated else ""
            lines.append(f"  {layer.key}: {owners}{extra}")
        return "\n".join(lines)


def _with_replicated(
    plan: OwnerPlan, replicated: Sequence[tuple[str, str, torch.Tensor]]
) -> OwnerPlan:
    """The plan plus the replicated parameters (owner 0), for the model check only."""
    if not replicated:
        return plan
    extra = tuple(
        MatrixItem(f"[all-reduced] {n}", (1, max(1, p.numel())), p.dtype, key)
        for n, key, p in replicated
    )
    items = plan.items + extra
    owners = plan.owners + (0,) * len(extra)
    return OwnerPlan(items, owners, (), plan.loads, plan.world_size, plan.replicate_size)
