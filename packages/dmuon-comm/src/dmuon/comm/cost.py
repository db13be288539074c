"""The cost of owning a matrix: Newton–Schulz FLOPs plus a byte term.

Balancing owners by element count looks balanced but is not: the Newton–Schulz
work of an ``m × n`` matrix grows like ``min(m, n)²·max(m, n)``, and DMuon's
authors report optimizer time varying about 4× across ranks under a numel-only
assignment. The default cost is therefore an estimate of the seconds an owner
spends on the matrix: its FLOPs at a sustained rate, its memory passes at a
sustained bandwidth, and a fixed overhead per Newton–Schulz call (kernel
launches), which is what batching same-shape matrices saves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

from dmuon.comm.flops import ns_flops
from dmuon.comm.items import MatrixItem

__all__ = ["CostSpec", "NSCost", "ShapeKey"]

# (rows, cols, dtype name): matrices with the same key can share one batched call.
ShapeKey = tuple[int, int, str]

CostSpec = Union["NSCost", Callable[[MatrixItem], float], Mapping[str, float], None]
"""What ``plan_owners(cost=...)`` accepts: an :class:`NSCost`, a function of the item,
a mapping from item name to a measured cost, or ``None`` (the default :class:`NSCost`)."""


@dataclass(frozen=True)
class NSCost:
    """Estimated seconds an owner spends on its matrices, batching included.

    For ``b`` matrices of shape ``m × n`` run as one batched call::

        seconds(m, n, b) = call_overhead
                         + b · ns_flops(m, n, method, steps, restarts) / flops_per_second
                         + b · byte_passes · m·n·element_size / bytes_per_second

    The FLOP term is :func:`~dmuon.comm.ns_flops` of the method that will run
    (it mirrors :func:`dmuon.kernels.ns_flops`); the byte term covers the
    memory-bound element-wise work around the products (momentum, normalisation,
    casts, the update), which dominates for small matrices; ``call_overhead``
    stands for the ~25–40 kernel launches of one call. Only the ratios between
    the three terms matter for balancing; the defaults describe a current
    datacentre GPU. Pass measured rates (or measured costs to
    :func:`~dmuon.comm.plan_owners`) when you know better.

    Attributes:
        method: ``"gram"`` or ``"standard"``.
        steps: Newton–Schulz steps.
        restarts: Gram restart iterations.
        flops_per_second: sustained matrix-product rate.
        bytes_per_second: sustained memory bandwidth.
        byte_passes: passes over the matrix by the element-wise work.
        call_overhead: seconds of fixed cost per (batched) call.

    Examples:
        >>> from dmuon.comm import MatrixItem
        >>> cost = NSCost(flops_per_second=1e12, bytes_per_second=1e11, call_overhead=0.0)
        >>> item = MatrixItem("w", (1024, 4096))
        >>> round(cost(item), 6)  # (8·1024²·4096 + 28·1024³)/1e12 + 10·4·1024·4096/1e11
        0.066102
    """

    method: str = "gram"
    steps: int = 5
    restarts: Sequence[int] = (2,)
    flops_per_second: float = 100e12
    bytes_per_second: float = 1e12
    byte_passes: float = 10.0
    call_overhead: float = 50e-6

    def __post_init__(self) -> None:
        if self.method not in ("gram", "standard"):
            raise ValueError(f"method must be 'gram' or 'standard', got {self.method!r}")
        for name in ("flops_per_second", "bytes_per_second"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("byte_passes", "call_overhead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)!r}")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps must be an int ≥ 0, got {self.steps!r}")
        object.__setattr__(self, "restarts", tuple(self.restarts))

    def matrix_seconds(self, m: int, n: int, element_size: int) -> float:
        """Seconds per matrix of a batched call, without the call overhead."""
        flops = ns_flops(m, n, method=self.method, steps=self.steps, restarts=self.restarts)
        return (
            flops / self.flops_per_second
            + self.byte_passes * m * n * element_size / self.bytes_per_second
        )

    def batch_seconds(self, m: int, n: int, element_size: int, batch: int) -> float:
        """Seconds of one batched call on ``batch`` matrices of shape ``m × n`` (none for
        no matrix or an empty one: the kernels launch nothing for it)."""
        if batch == 0 or m * n == 0:
            return 0.0
        return self.call_overhead + batch * self.matrix_seconds(m, n, element_size)

    def __call__(self, item: MatrixItem) -> float:
        """Seconds to orthogonalise ``item`` alone (its batch as one call)."""
        return self.batch_seconds(item.rows, item.cols, item.element_size, item.batch)


def shape_key(item: MatrixItem) -> ShapeKey:
    """Matrices that can share one batched Newton–Schulz call."""
    return (item.rows, item.cols, str(item.dtype).removeprefix("torch."))


class Costing:
    """Resolved costs for one planning call: per item, per unit, per rank (internal).

    ``batchable`` is True when costs come from a shape model (an :class:`NSCost` or
    a ``batch_cost`` function): then same-shape matrices on one rank share batched
    calls of at most ``max_batch`` matrices, and a rank's load is the cheapest split
    of each shape's matrices into such calls. Otherwise (a function of the item or
    a table of measured costs) a rank's load is the sum of its items' costs.
    """

    def __init__(
        self,
        items: Sequence[MatrixItem],
        cost: CostSpec,
        batch_cost: Callable[[ShapeKey, int], float] | None,
        max_batch: int,
    ) -> None:
        self.max_batch = max_batch
        self.batch_cost: Callable[[ShapeKey, int], float] | None
        self._memo: dict[tuple[ShapeKey, int], float] = {}
        self.item_cost: dict[str, float] = {}
        if batch_cost is not None:
            self.batch_cost = batch_cost
        elif cost is None or isinstance(cost, NSCost):
            ns = cost if isinstance(cost, NSCost) else NSCost()
            sizes = {shape_key(i): i.element_size for i in items}

            def from_ns(key: ShapeKey, b: int) -> float:
                return ns.batch_seconds(key[0], key[1], sizes[key], b)

            self.batch_cost = from_ns
        else:
            self.batch_cost = None
        if self.batch_cost is not None:
            for item in items:
                self.item_cost[item.name] = self.shape_load(shape_key(item), item.batch)
        elif isinstance(cost, Mapping):
            missing = [i.name for i in items if i.name not in cost]
            if missing:
                raise ValueError(
                    f"cost: the mapping of measured costs has no entry for {len(missing)} "
                    f"item(s), e.g. {missing[:3]}; give a cost for every item name"
                )
            self.item_cost = {i.name: float(cost[i.name]) for i in items}
        elif callable(cost):
            self.item_cost = {i.name: float(cost(i)) for i in items}
        else:
            raise ValueError(
                "cost must be None, an NSCost, a function of a MatrixItem or a mapping "
                f"from item name to cost, got {type(cost).__name__}"
            )
        bad = {n: c for n, c in self.item_cost.items() if not (c >= 0 and c < float("inf"))}
        if bad:
            raise ValueError(
                f"cost: costs must be finite and ≥ 0, got {dict(list(bad.items())[:3])}"
            )

    def call_cost(self, key: ShapeKey, b: int) -> float:
        """Cost of one batched call of ``b`` matrices (batchable costing only)."""
        assert self.batch_cost is not None
        value = float(self.batch_cost(key, b))
        if not (value >= 0 and value < float("inf")):
            raise ValueError(f"batch_cost{(key, b)} must be finite and ≥ 0, got {value!r}")
        return value

    def shape_load(self, key: ShapeKey, count: int) -> float:
        """Cheapest cost of ``count`` matrices of one shape in calls of ≤ ``max_batch``."""
        if count == 0:
            return 0.0
        memo_key = (key, count)
        if memo_key in self._memo:
            return self._memo[memo_key]
        best = [0.0] + [float("inf")] * count
        calls = [self.call_cost(key, b) for b in range(1, min(count, self.max_batch) + 1)]
        for total in range(1, count + 1):
            for b in range(1, min(total, self.max_batch) + 1):
                best[total] = min(best[total], best[total - b] + calls[b - 1])
        self._memo[memo_key] = best[count]
        return best[count]

    def rank_load(self, items: Sequence[MatrixItem]) -> float:
        """Load of one rank holding ``items``."""
        if self.batch_cost is None:
            return sum(self.item_cost[i.name] for i in items)
        counts: dict[ShapeKey, int] = {}
        for i in items:
            key = shape_key(i)
            counts[key] = counts.get(key, 0) + i.batch
        return sum(self.shape_load(k, counts[k]) for k in sorted(counts))
