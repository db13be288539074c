"""The record owner mode keeps per layer, shared by its two sides.

:class:`~dmuon.optim.engine.OwnerExchange` (``exchange.py``) groups the parameters
into layers (:func:`group_layers`) and builds each layer's buckets
(:meth:`OwnerLayer.make_buckets`); :class:`~dmuon.optim.engine.Reduction` (the
reduction side, ``reduction.py``) fills and reads the reduction fields,
:class:`~dmuon.optim.engine.Publication` (the broadcast side, ``publication.py``)
the publication fields. Both hold the same :class:`OwnerLayer` objects, in natural
(forward) layer order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dmuon.comm import CommHandle, FlatBucket, MatrixItem, OwnerPlan, make_buckets
from dmuon.comm.owner_plan import natural_key
from dmuon.optim.matrix_split import local_tensor

__all__ = ["OwnerLayer", "group_layers"]


@dataclass(eq=False)
class OwnerLayer:
    """One layer of an owner-mode model: its parameters, buffers and in-flight traffic.

    Attributes:
        key: the layer key (``blocks.3``), the unit of the step's pipeline.
        dedicated: names of its dedicated parameters (stepped by their owners).
        replicated: names of its all-reduced parameters (stepped by every rank).
        reduce_buckets: flat buffers the dedicated gradients are reduced to owners in.
        publish_buckets: flat buffers the dedicated weights live in and are broadcast
            from (the parameters are views into them).
        allreduce_buckets: flat buffers of the replicated gradients, one per dtype.
        ready: names whose gradient has arrived this step.
        launched: whether the layer's reductions were started this step.
        reduce_handle: the reduction in flight.
        allreduce_works: the replicated all-reduces in flight.
        reduced: whether the reductions were waited on and ``p.grad`` set.
        publish_handle: the broadcast in flight.
        resident: whether the layer's weights are materialised (ZeRO-3-like).
    """

    key: str
    dedicated: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    reduce_buckets: list[FlatBucket] = field(default_factory=list)
    publish_buckets: list[FlatBucket] = field(default_factory=list)
    allreduce_buckets: list[FlatBucket] = field(default_factory=list)
    ready: set[str] = field(default_factory=set)
    launched: bool = False
    reduce_handle: CommHandle | None = None
    allreduce_works: list[object] = field(default_factory=list)
    reduced: bool = False
    publish_handle: CommHandle | None = None
    resident: bool = True

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
            raise ValueError(f"parameter {item.name!r} is dedicated twice")
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
