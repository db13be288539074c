"""The record owner mode keeps per layer, shared by its two halves.

:class:`~dmuon.optim.engine.OwnerExchange` (the reduction side, ``exchange.py``)
fills and reads the reduction fields; :class:`~dmuon.optim.engine.Publication`
(the broadcast side, ``publication.py``) the publication fields. Both hold the
same :class:`OwnerLayer` objects, in natural (forward) layer order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dmuon.comm import CommHandle, FlatBucket

__all__ = ["OwnerLayer"]


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
