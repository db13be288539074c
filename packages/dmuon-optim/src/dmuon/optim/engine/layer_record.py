"""The record owner mode keeps per layer, shared by its two sides.

:class:`~dmuon.optim.engine.OwnerExchange` (``exchange.py``) groups the parameters
into layers (:func:`group_layers`) and builds each layer's buckets
(:meth:`OwnerLayer.make_buckets`); :class:`~dmuon.optim.engine.Reduction` (the
reduction side, ``reduction.py``) fills and reads the reduction fields,
:class:`~dmuon.optim.engine.Publication` (the broadcast side, ``publication.py``)
the publication fields. Both hold the same :class:`OwnerLayer` objects, in natural
(forward) layer order.

A record is the unit of the step's pipeline: one reduction, one step and one
publication per owner. Layers too small to pay for a collective of their own are
packed together first (:func:`pack_layers`), as DDP packs gradients into buckets:
on a model of many small layers the per-collective latency, not the bytes, bounds
the step (``benchmarks/step_overhead.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dmuon.comm import CommHandle, FlatBucket, MatrixItem, OwnerPlan, make_buckets
from dmuon.comm.owner_plan import natural_key
from dmuon.optim.engine.layer_packing import DEFAULT_PACK_MB, pack_runs
from dmuon.optim.matrix_split import local_tensor

__all__ = ["DEFAULT_PACK_MB", "OwnerLayer", "group_layers", "pack_layers"]


@dataclass(eq=False)
class OwnerLayer:
    """One layer of an owner-mode model: its parameters, buffers and in-flight traffic.

    Attributes:
        key: the layer key (``blocks.3``), the unit of the step's pipeline; a pack of
            several layers is named ``first..last`` (``blocks.0..blocks.7``).
        members: the layer keys it holds, in natural order (``(key,)`` for one layer;
            the forward pre-hooks go on each member's module).
        dedicated: names of its dedicated parameters (stepped by their owners).
        replicated: names of its all-reduced parameters (stepped by every rank).
        reduce_buckets: flat buffers the dedicated gradients are reduced to owners in
            (ZeRO-3-like: only from the layer's launch until its reduction is waited on,
            :meth:`open_reduce_buckets`, :meth:`close_reduce_buckets`).
        publish_buckets: flat buffers the dedicated weights live in and are broadcast
            from (the parameters are views into them).
        allreduce_buckets: flat buffers of the replicated gradients, one per dtype.
        ready: names whose gradient has arrived this step.
        launched: whether the layer's reductions were started this step.
        launch_sum: the sum of this rank's gradients as its launch copied them into the
            buckets (fp32; ``None`` when not taken): finite, it proves every one of them
            finite (see :meth:`~dmuon.optim.engine.reduction.Reduction.finite_at_launch`).
        reduce_handle: the reduction in flight.
        allreduce_works: the replicated all-reduces in flight.
        reduced: whether the reductions were waited on and ``p.grad`` set.
        publish_handle: the broadcast in flight.
        resident: whether the layer's weights are materialised (ZeRO-3-like).
    """

    key: str
    members: tuple[str, ...] = ()
    dedicated: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    reduce_buckets: list[FlatBucket] = field(default_factory=list)
    publish_buckets: list[FlatBucket] = field(default_factory=list)
    allreduce_buckets: list[FlatBucket] = field(default_factory=list)
    ready: set[str] = field(default_factory=set)
    launched: bool = False
    launch_sum: torch.Tensor | None = None
    reduce_handle: CommHandle | None = None
    allreduce_works: list[object] = field(default_factory=list)
    reduced: bool = False
    publish_handle: CommHandle | None = None
    resident: bool = True
    # how make_buckets laid out the reduce buckets, to make them again (open_reduce_buckets)
    reduce_layout: tuple[OwnerPlan, torch.device] | None = None

    def __post_init__(self) -> None:
        if not self.members:
            self.members = (self.key,)

    @property
    def expected(self) -> int:
        """How many gradients complete the layer (dedicated and replicated)."""
        return len(self.dedicated) + len(self.replicated)

    def make_buckets(self, plan: OwnerPlan, params: Mapping[str, torch.Tensor]) -> None:
        """Build the layer's flat buffers on its parameters' device: reduce and publish
        buckets of the dedicated parameters (by the plan: over ``dp × tp``, the plan of
        the local shapes), one all-reduce bucket per dtype of the replicated ones (a
        DTensor by its local part)."""
        device = params[[*self.dedicated, *self.replicated][0]].device
        self.reduce_layout = (plan, device)
        self.reduce_buckets = make_buckets(plan, names=self.dedicated, device=device)
        self.publish_buckets = make_buckets(plan, names=self.dedicated, device=device)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in self.replicated:
            by_dtype.setdefault(params[name].dtype, []).append(name)
        self.allreduce_buckets = [
            FlatBucket(
                [(n, tuple(local_tensor(params[n]).shape)) for n in names], dtype=dt, device=device
            )
            for dt, names in by_dtype.items()
        ]

    def close_reduce_buckets(self) -> None:
        """Drop the reduce buckets until :meth:`open_reduce_buckets` (ZeRO-3-like).

        The layer's gradients need them only from its launch until its reduction is
        waited on: kept for the life of the exchange, every layer's would hold ``Φ_M e``
        through the next forward and backward, where the ZeRO-3-like mode saves the
        weights. The reduced gradients the owner's ``p.grad`` holds are views that keep
        their own bucket's storage alive until ``zero_grad()`` drops them; a bucket of
        another owner is freed here.
        """
        self.reduce_buckets = []

    def open_reduce_buckets(self) -> None:
        """Make the reduce buckets again, as :meth:`make_buckets` laid them out, if
        :meth:`close_reduce_buckets` dropped them (new storage: the gradients the last
        step left on the owner stay views of the old)."""
        if not self.reduce_buckets and self.dedicated and self.reduce_layout is not None:
            plan, device = self.reduce_layout
            self.reduce_buckets = make_buckets(plan, names=self.dedicated, device=device)


def group_layers(
    dedicated: Sequence[tuple[MatrixItem, torch.Tensor]],
    replicated: Sequence[tuple[str, str, torch.Tensor]],
    plan: OwnerPlan,
) -> tuple[list[OwnerLayer], dict[str, torch.Tensor], dict[str, str]]:
    """Group the parameters of an owner-mode model by layer.

    Args:
        dedicated: ``(item, parameter)`` pairs; an item's layer (or, without one, its
            name) is its layer key.
        replicated: ``(name, layer key, parameter)`` triples of all-reduced parameters.
        plan: the owner plan, which must cover exactly the dedicated items.

    Returns:
        The layer records in natural (forward) order (no buckets yet), every parameter
        by name, and each name's layer key.

    Raises:
        ValueError: a name given twice, or a plan that does not cover the items.
    """
    params: dict[str, torch.Tensor] = {}
    layer_of: dict[str, str] = {}
    layers: dict[str, OwnerLayer] = {}
    for item, p in dedicated:
        if item.name in params:
            raise ValueError(
                f"parameter {item.name!r} is dedicated twice: the dedicated items name it more "
                "than once (each parameter is dedicated once, under one name)"
            )
        if item.name not in plan:
            raise ValueError(f"the plan has no item {item.name!r}; plan every dedicated item")
        params[item.name] = p
        key = item.layer if item.layer is not None else item.name
        layer_of[item.name] = key
        layers.setdefault(key, OwnerLayer(key)).dedicated.append(item.name)
    if len(params) != len(plan):
        raise ValueError(f"the plan has {len(plan)} items for {len(params)} parameters")
    for name, key, p in replicated:
        if name in params:
            raise ValueError(f"parameter {name!r} is both dedicated and replicated")
        params[name] = p
        layer_of[name] = key
        layers.setdefault(key, OwnerLayer(key)).replicated.append(name)
    return [layers[k] for k in sorted(layers, key=natural_key)], params, layer_of


def pack_layers(
    layers: Sequence[OwnerLayer],
    params: Mapping[str, torch.Tensor],
    layer_of: Mapping[str, str],
    max_bytes: int,
) -> tuple[list[OwnerLayer], dict[str, str]]:
    """Pack consecutive small layers into one record each, up to ``max_bytes``.

    Greedy in natural (forward) order (the rule of
    :func:`~dmuon.optim.engine.layer_packing.pack_runs`, which the planner prices the
    step by too): a pack takes the next layer while the bytes of
    its parameters (dedicated and replicated, each rank's local part) stay within
    ``max_bytes`` and the layer is on the pack's device (a record's buffers are on one
    device, :meth:`OwnerLayer.make_buckets`, so the layers of a model spread over
    devices are packed per device); a layer larger than that is a pack of its own. A
    pack is reduced, stepped and published as one layer: one collective per owner
    instead of one per owner *and* layer. Its gradients start travelling when the last
    of its layers' gradients has arrived (the first layer's, in backward), so a pack
    trades a little overlap with backward for fewer collectives; layers worth
    overlapping are larger than the default limit (:data:`DEFAULT_PACK_MB`) and stay
    alone.

    Args:
        layers: the records in natural order, with no buckets yet.
        params: every parameter by name.
        layer_of: each name's layer key.
        max_bytes: the limit; ``0``: every layer its own record (nothing packed).

    Returns:
        The packed records and each name's pack key.

    Examples:
        >>> import torch
        >>> layers = [OwnerLayer(f"b.{i}", replicated=[f"b.{i}.w"]) for i in range(3)]
        >>> params = {f"b.{i}.w": torch.zeros(4) for i in range(3)}  # 16 bytes each
        >>> packed, of = pack_layers(layers, params, {n: n[:3] for n in params}, 32)
        >>> [(p.key, p.members) for p in packed], of["b.1.w"]
        ([('b.0..b.1', ('b.0', 'b.1')), ('b.2', ('b.2',))], 'b.0..b.1')
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 (0: no packing), got {max_bytes}")
    if max_bytes == 0 or len(layers) < 2:
        return list(layers), dict(layer_of)
    sizes: list[tuple[int, int, torch.device]] = []
    for i, layer in enumerate(layers):
        names = (*layer.dedicated, *layer.replicated)
        nbytes = sum(local_tensor(params[n]).numel() * params[n].element_size() for n in names)
        # the device make_buckets puts the layer's buffers on
        sizes.append((i, nbytes, params[names[0]].device))
    runs = [[layers[i] for i in run] for run in pack_runs(sizes, max_bytes)]
    packed: list[OwnerLayer] = []
    out = dict(layer_of)
    for run in runs:
        if len(run) == 1:
            packed.append(run[0])
            continue
        pack = OwnerLayer(
            f"{run[0].key}..{run[-1].key}",
            members=tuple(m for layer in run for m in layer.members),
            dedicated=[n for layer in run for n in layer.dedicated],
            replicated=[n for layer in run for n in layer.replicated],
        )
        for n in (*pack.dedicated, *pack.replicated):
            out[n] = pack.key
        packed.append(pack)
    return packed, out
