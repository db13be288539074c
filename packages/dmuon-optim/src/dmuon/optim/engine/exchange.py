"""Owner-mode traffic of one model: gradients reduced to owners, results published back.

This is the communication of DMuon's owner-centric execution (Chen et al., *Efficient
Distributed Muon Training with Near-Adam Overhead*, 2026). Every *dedicated* parameter
has one owner rank from an :class:`~dmuon.comm.OwnerPlan`:

* its gradient is reduced (averaged) to the owner only, layer by layer, while backward
  goes on — the reduction side, :class:`~dmuon.optim.engine.Reduction`
  (``reduction.py``), held as :attr:`OwnerExchange.reduction`;
* only the owner steps it; the other ranks hold no gradient and no momentum for it;
* the new weight is broadcast from the owner, one collective per owner per layer,
  started as soon as that layer's step is done and waited only where the weight is
  next needed — the publication side, :class:`~dmuon.optim.engine.Publication`
  (``publication.py``), held as :attr:`OwnerExchange.publication`.

Per step and rank that is ``(N−1)/N·P`` bytes for the reductions and as much for
the broadcasts: ``2(N−1)/N·P``, one ring all-reduce, with each matrix orthogonalised
once. :class:`OwnerExchange` builds the two sides over one
:class:`~dmuon.optim.engine.layer_record.OwnerLayer` record per layer and answers
the lookups (names, owners, layers); callers talk to the side they need
(``exchange.reduction.grad_ready(p)``, ``exchange.publication.publish(key)``).

Over a ``dp × tp`` mesh (``group`` the ``dp`` group; tensor-parallel DTensor
parameters), the plan weighs the whole matrices and the buckets carry each rank's
shard: :mod:`~dmuon.optim.engine.owner_split`.

The publication buckets *are* the weights: every dedicated parameter's ``.data`` is
a view into its layer's broadcast buffer, so the owner's in-place step writes
straight into what it broadcasts and the other ranks receive straight into their
parameters (no packing copies). Move the model to its device before dedicating it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import (
    CommStats,
    MatrixItem,
    OwnerPlan,
    default_stats,
    wait_work,
)
from dmuon.comm.flags import flag_device
from dmuon.comm.process_groups import group_rank, group_size
from dmuon.comm.torch_compat import all_gather_single
from dmuon.optim.engine.layer_packing import DEFAULT_PACK_MB, check_pack_mb
from dmuon.optim.engine.layer_record import OwnerLayer, group_layers, pack_layers
from dmuon.optim.engine.model_agreement import check_model_consistency, plan_with_replicated
from dmuon.optim.engine.owner_split import check_split_model, local_plan
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.publication import Publication
from dmuon.optim.engine.reduction import Reduction
from dmuon.optim.engine.tensor_split import tensor_groups

__all__ = ["OwnerExchange", "any_dedicated", "exchange_of", "format_description"]

# id(parameter) → (weak reference to it, weak reference to its exchange). Keyed by id:
# tensors compare elementwise, so they cannot be dictionary keys by value. The exchange
# is held weakly: it holds the parameters (and its buckets, as much memory again), so a
# strong reference here would keep every dedicated model alive for the whole process,
# and its parameters "dedicated" with no object left to let them go. The exchange lives
# as long as something of the run holds it: the dedication, its hooks on the model, the
# optimizer's engine.
_REGISTRY: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[OwnerExchange]]] = {}


def exchange_of(p: torch.Tensor) -> OwnerExchange | None:
    """The :class:`OwnerExchange` a parameter was dedicated to (``None``: not dedicated,
    or its exchange was let go or freed)."""
    entry = _REGISTRY.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def any_dedicated() -> bool:
    """Whether any parameter of this process may be dedicated (``False``: none is, and
    :func:`exchange_of` answers ``None`` for every parameter without a lookup)."""
    return bool(_REGISTRY)


def _register(p: torch.Tensor, exchange: OwnerExchange) -> None:
    key = id(p)
    registry = _REGISTRY  # bound now: module globals are gone at interpreter exit
    _REGISTRY[key] = (weakref.ref(p, lambda _: registry.pop(key, None)), weakref.ref(exchange))


def _forget(registry: dict[int, Any], keys: list[int]) -> None:
    """An exchange was freed: drop its parameters' entries (those not taken since by
    another exchange), so that :func:`any_dedicated` answers ``False`` again."""
    for key in keys:
        entry = registry.get(key)
        if entry is not None and entry[1]() is None:
            registry.pop(key, None)


def slot_ranks(
    group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None
) -> tuple[int, ...]:
    """The global rank of each owner slot ``i·S + j`` (``i`` the replica, ``j`` the rank in
    the shard group): the group's ranks in group order, and under HSDP every replica's
    row, gathered over the replicate group (one small all-gather, when the dedication is
    built). ``(0,)`` without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return (0,)
    S = group_size(group)
    row = [dist.get_global_rank(group, j) if group is not None else j for j in range(S)]
    if replicate_group is None or group_size(replicate_group) == 1:
        return tuple(row)
    mine = torch.tensor(row, dtype=torch.int64, device=flag_device(replicate_group))
    rows = torch.empty(group_size(replicate_group) * S, dtype=torch.int64, device=mine.device)
    work = all_gather_single(rows, mine, group=replicate_group, async_op=True)
    wait_work(work, "all-gather of the HSDP mesh's ranks (owner slots)", replicate_group)
    return tuple(int(r) for r in rows.tolist())


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
            :mod:`dmuon.optim.engine.publication`); 1-D groups of plain tensors only.
        reduce_op: ``"avg"`` (default): every gradient reduced to its owner (and every
            all-reduced one) is the mean over the ranks, as DDP's and FSDP2's; ``"sum"``:
            the sum, for a trainer whose loss is already divided by the global batch
            (torchtitan divides by the global token count and sets FSDP2's gradient
            divide factor to 1).
        free_local_grads: release each rank's local gradient of a dedicated or
            all-reduced parameter (``p.grad = None``) as soon as it is copied into its
            bucket (the reduced one replaces it in the step), as
            FSDP2 releases the unsharded gradient after its reduce-scatter: one gradient
            copy less during backward, and after backward no plain-tensor gradient beside
            FSDP2's DTensor ones (a trainer's own norm over every ``p.grad``, torchtitan's,
            would otherwise mix the two). Default ``False``: the local gradients stay until
            the step.
        layer_pack_mb: consecutive layers (natural order) are packed into one unit of
            reduction, step and publication while the pack's parameters hold at most
            this many MiB (:func:`~dmuon.optim.engine.layer_record.pack_layers`): one
            collective per owner and pack instead of per owner and layer, which is
            what bounds the step of a model of many small layers. Default 1 MiB, DDP's
            first bucket; ``0``: one unit per layer; ``float("inf")``: no limit. Never
            packed together: layers on different devices. Not packed: ZeRO-3-like
            (``reshard_after_forward``) and tensor-parallel models. Every rank must pack
            alike (checked: :class:`~dmuon.optim.ModelMismatchError` on every rank).
        experts: expert stacks stepped where they live beside the dedicated parameters
            (``ddp.dedicate``/``fsdp.dedicate`` pass the stacks whose mesh spans
            ``group``): the exchange does not reduce them; with ``reduce_op="avg"``
            :func:`~dmuon.integrations.install_hooks` divides their gradients by the
            group's size as they arrive (the dispatch's backward sums every rank's loss
            into them), and the optimizer's engine sums them among their replicas.

    Attributes:
        reduction: the reduction side (:class:`~dmuon.optim.engine.Reduction`): the
            backward hooks call its ``grad_ready``, the engine its ``wait_reduced``.
        publication: the publication side (:class:`~dmuon.optim.engine.Publication`):
            the engine calls its ``publish``, the forward hooks its ``forward_enter``.
        layers: the :class:`~dmuon.optim.engine.OwnerLayer` records both sides share,
            in natural (forward) order.
        plan: the owner plan, by the whole shapes.
        local_plan: the plan the buckets and collectives use: ``plan`` with this rank's
            local shape of every tensor-parallel DTensor (``plan`` itself without them).
        tensor_groups: the ``tp`` groups the dedicated matrices are split over, or held
            whole over (a ``Replicate()`` DTensor; none without tensor parallelism).

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
        reduce_op: str = "avg",
        free_local_grads: bool = False,
        layer_pack_mb: float = DEFAULT_PACK_MB,
        experts: Sequence[torch.Tensor] = (),
    ) -> None:
        pack_bytes = check_pack_mb(layer_pack_mb)
        if reduce_op not in ("avg", "sum"):
            raise ValueError(
                f"reduce_op must be 'avg' (gradients averaged over the ranks, as DDP and "
                f"FSDP2 by default) or 'sum' (a trainer that divides its loss by the global "
                f"token count, as torchtitan), got {reduce_op!r}"
            )
        self.plan = plan
        self.group = group
        self.replicate_group = replicate_group
        self.stats = stats if stats is not None else default_stats()
        # expert stacks stepped where they live beside the dedicated parameters (dedicate's
        # in-place experts): not reduced by this exchange, their gradients taken as the
        # expert dispatch sums them, divided by the group's size as they arrive when
        # reduce_op is "avg" (the hooks install_hooks installs)
        self.experts = tuple(experts)
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
        split = [name for name, p in ((i.name, p) for i, p in dedicated) if is_dtensor(p)]
        split += [name for name, _, p in replicated if is_dtensor(p)]
        if split and (reshard_after_forward or replicate_group is not None):
            raise ValueError(
                f"parameter {split[0]!r} is a tensor-parallel DTensor: owner mode steps those "
                "on a dp × tp mesh with the dedicated weights resident (no "
                "reshard_after_forward) and without HSDP"
            )
        if replicated and replicate_group is not None:
            raise ValueError(
                "replicated (all-reduced) parameters are for the DDP replacement on a 1-D "
                "group; under HSDP leave the scalar parameters to FSDP2"
            )
        for item, p in dedicated:
            if exchange_of(p) is not None:
                raise ValueError(
                    f"parameter {item.name!r} is dedicated twice: it is already held by "
                    "another dedication (its OwnerExchange, which its hooks, its Dedication "
                    "or an optimizer built on it keep alive). Call Dedication.undedicate() "
                    "on every rank on the first dedication to let its parameters go (or "
                    "drop every reference to it: the Dedication, the DMuon built on it, and "
                    "its hooks with Dedication.remove()), then dedicate again"
                )
        self.layers, self._params, self._layer_of = group_layers(dedicated, replicated, plan)
        if not (split or reshard_after_forward):
            # ZeRO-3-like frees a layer after its own forward; a tensor-parallel layer's
            # shards are stepped by its owner's tp row: both stay one layer a unit
            self.layers, self._layer_of = pack_layers(
                self.layers, self._params, self._layer_of, pack_bytes
            )
        # by its key, and a pack by each of its layers' keys too
        self._by_key = {k: layer for layer in self.layers for k in {layer.key, *layer.members}}
        self.tensor_groups = tensor_groups(
            (EngineParam(i.name, p, 0, 0, True, "", i) for i, p in dedicated), group
        )
        # One model check before anything else travels (no-op on one rank).
        if self.tensor_groups:
            check_split_model(plan_with_replicated(plan, replicated), group, self.tensor_groups)
        else:
            # each parameter's unit too: ranks that pack their layers differently (another
            # layer_pack_mb) would reduce and publish buffers of other sizes
            check_model_consistency(
                plan_with_replicated(plan, replicated, self._layer_of), group, replicate_group
            )
        # the global rank of each slot (checkpoints name an owner by it, over the world):
        # after the model check, which is the first collective
        self.slot_ranks = slot_ranks(group, replicate_group)
        self.local_plan = local_plan(plan, self._params)
        for layer in self.layers:
            layer.dedicated.sort(key=plan.index)
            layer.make_buckets(self.local_plan, self._params)
        for _, p in dedicated:
            _register(p, self)
        # no reference to self in the finaliser: it would keep the exchange alive
        weakref.finalize(self, _forget, _REGISTRY, [id(p) for _, p in dedicated])
        self.publication = Publication(
            self.layers,
            self._params,
            self.local_plan,
            rank=self.rank,
            world_size=self.world_size,
            group=group,
            replicate_group=replicate_group,
            stats=self.stats,
            reshard_after_forward=reshard_after_forward,
        )
        self.reduction = Reduction(
            self.layers,
            self._params,
            self._layer_of,
            self.local_plan,
            group=group,
            replicate_group=replicate_group,
            stats=self.stats,
            publication=self.publication,
            reduce_op=reduce_op,
            free_local_grads=free_local_grads,
        )
        self.publication.synchronize_parameters()
        self.publication.release_all()

    # ------------------------------------------------------------------ lookups

    def undedicate(self) -> None:
        """Let the dedicated parameters go: :func:`exchange_of` answers ``None`` for them
        again, so a new dedication may take them (after a setup that failed once the
        dedication was built; its hooks are removed by the caller first)."""
        for p in self._params.values():
            if exchange_of(p) is self:
                _REGISTRY.pop(id(p), None)

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
        return self.reduction.name_by_id.get(id(p))

    def layer_of(self, name: str) -> str:
        """The layer key of the dedicated or replicated parameter called ``name``."""
        return self._layer_of[name]

    def layer_keys(self) -> list[str]:
        """The keys of the units of the step (layers, or packs of small layers:
        :attr:`OwnerLayer.members <dmuon.optim.engine.layer_record.OwnerLayer>`), in
        natural (forward) order."""
        return [layer.key for layer in self.layers]

    def layer_names(self, key: str) -> list[str]:
        """The dedicated and replicated parameter names of layer ``key`` (of the whole
        pack, for a key of a layer packed with others)."""
        layer = self._by_key[key]
        return [*layer.dedicated, *layer.replicated]

    def layer(self, key: str) -> OwnerLayer:
        """The record of layer ``key`` (its parameters, buckets and traffic in flight):
        a key of :meth:`layer_keys`, or of a layer packed into one of them."""
        return self._by_key[key]

    def wait_all_published(self) -> None:
        """Every rank holds the owners' latest weights (``Dedication.wait()`` calls it).

        ``exchange.publication.wait_all_published()``, made on every rank: a forward
        past the layers' hooks reads current weights then, and their gradients are not
        refused (:meth:`Publication.mark_all_waited`). Call it before reading the weights
        outside a forward (ZeRO-3-like: it materialises every layer).
        """
        self.publication.wait_all_published()
        self.publication.mark_all_waited()

    def describe(self) -> dict[str, Any]:
        """The plan and, per layer, each parameter's owner (:func:`format_description`
        turns it into text)."""
        return {
            "plan": repr(self.plan),
            "layers": {
                layer.key: {
                    "owners": {n: self.plan.owner(n) for n in layer.dedicated},
                    "all_reduced": list(layer.replicated),
                }
                for layer in self.layers
            },
        }


def format_description(description: dict[str, Any]) -> str:
    """:meth:`OwnerExchange.describe` as text: the plan, then one line per layer.

    Examples:
        >>> print(format_description({"plan": "OwnerPlan(2 items)", "layers": {
        ...     "blocks.0": {"owners": {"blocks.0.w": 1}, "all_reduced": ["blocks.0.b"]}}}))
        OwnerPlan(2 items)
          blocks.0: blocks.0.w→1; all-reduced: blocks.0.b
    """
    lines = [str(description["plan"])]
    for key, layer in description["layers"].items():
        owners = ", ".join(f"{n}→{o}" for n, o in layer["owners"].items())
        replicated = layer["all_reduced"]
        extra = f"; all-reduced: {', '.join(replicated)}" if replicated else ""
        lines.append(f"  {key}: {owners}{extra}")
    return "\n".join(lines)
