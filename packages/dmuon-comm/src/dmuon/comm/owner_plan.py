"""The result of owner planning: who owns which matrix, and how loaded each rank is."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from dmuon.comm.items import MatrixItem

__all__ = ["OwnerPlan", "OwnerUnit", "natural_key"]

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[tuple[int, int | str], ...], str]:
    """Sort key that orders ``layers.2`` before ``layers.10``.

    Numbers compare as numbers; names they make equal (``w1``, ``w01``) by the name
    itself, so that an order by this key never depends on the order it started from.

    Examples:
        >>> sorted(["h.10.w", "h.2.w", "h.1.w"], key=natural_key)
        ['h.1.w', 'h.2.w', 'h.10.w']
        >>> sorted(["w1", "w01"], key=natural_key) == sorted(["w01", "w1"], key=natural_key)
        True
    """
    parts = tuple(
        (0, int(part)) if part.isdecimal() else (1, part) for part in _DIGITS.split(name) if part
    )
    return parts, name


@dataclass(frozen=True)
class OwnerUnit:
    """Items that are assigned together: one matrix, or the small matrices of one layer.

    Attributes:
        name: the item's name, or ``"<layer>[packed: a, b, …]"`` for a packed unit.
        items: names of the items in the unit (canonical order).
        layer: the layer key (``None`` for an item without one).
        cost: the unit's cost as seen by the planner (sum of its items' costs).
        owner: the rank that owns every item of the unit.

    Examples:
        >>> OwnerUnit("w", ("w",), None, 1.5, owner=2).owner
        2
    """

    name: str
    items: tuple[str, ...]
    layer: str | None
    cost: float
    owner: int


@dataclass(frozen=True, repr=False)
class OwnerPlan:
    """Which rank owns each matrix; a pure function of the planner's inputs.

    Every rank computes the same plan from the same items without communicating;
    :meth:`digest` summarises what the collectives depend on (the items, their
    shapes and dtypes, the owners and the layout) so that
    :func:`~dmuon.comm.check_plan_consistency` can compare it across ranks.

    Items are kept in a canonical order (natural sort of their names, so
    ``layers.2`` comes before ``layers.10``) that does not depend on the order they
    were given in; :meth:`items_of` lists a rank's items in that order, which is
    also the order of the bucket layouts.

    For HSDP (``replicate_size = R > 1``) ranks are the slots of an
    ``R × S`` (replicate, shard) mesh, numbered ``i·S + j``: an owner is reached by
    reducing within its shard group to shard index ``j`` and then across its
    replicate group to replica ``i`` (:meth:`shard_owner`, :meth:`replicate_owner`).

    Attributes:
        items: every item, in canonical order.
        owners: the owner (rank, or slot ``i·S + j`` for HSDP) of each item.
        units: the assignment units (single items and packed groups).
        loads: each rank's load under the plan's cost model (with the matrices it holds
            outside the plan, ``plan_owners(held=...)``).
        world_size: number of ranks ``R·S``.
        replicate_size: ``R``; 1 unless HSDP.
        strategy: the strategy asked for.
        solver: what produced the owners (e.g. ``"lpt"``, ``"ilp (optimal)"``,
            ``"lpt (ilp fallback: scipy not installed)"``).

    Examples:
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> items = [MatrixItem(f"h.{i}.w", (256, 256), layer=f"h.{i}") for i in range(4)]
        >>> plan = plan_owners(items, 2)
        >>> [plan.owner(f"h.{i}.w") for i in range(4)], plan.imbalance()
        ([0, 1, 0, 1], 0.0)
    """

    items: tuple[MatrixItem, ...]
    owners: tuple[int, ...]
    units: tuple[OwnerUnit, ...]
    loads: tuple[float, ...]
    world_size: int
    replicate_size: int = 1
    strategy: str = "lpt"
    solver: str = "lpt"
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    _by_rank: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.items) != len(self.owners):
            raise ValueError(f"owners has {len(self.owners)} entries for {len(self.items)} items")
        if self.world_size < 1 or self.replicate_size < 1 or self.world_size % self.replicate_size:
            raise ValueError(
                f"world_size ({self.world_size}) must be a positive multiple of "
                f"replicate_size ({self.replicate_size})"
            )
        if len(self.loads) != self.world_size:
            raise ValueError(f"loads has {len(self.loads)} entries for {self.world_size} ranks")
        bad = [o for o in self.owners if not 0 <= o < self.world_size]
        if bad:
            raise ValueError(f"owners must be ranks in [0, {self.world_size}), got {bad[:3]}")
        index = {item.name: k for k, item in enumerate(self.items)}
        if len(index) != len(self.items):
            raise ValueError("item names must be unique")
        object.__setattr__(self, "_index", index)
        # the ranks that own something (a plan over many more ranks than items stays small)
        by_rank: dict[int, list[int]] = {}
        for k, owner in enumerate(self.owners):
            by_rank.setdefault(owner, []).append(k)
        object.__setattr__(self, "_by_rank", {r: tuple(ks) for r, ks in by_rank.items()})

    # -- lookups -----------------------------------------------------------------

    @property
    def shard_size(self) -> int:
        """``S``: ranks per shard group (``world_size`` unless HSDP)."""
        return self.world_size // self.replicate_size

    @property
    def names(self) -> tuple[str, ...]:
        """Every item name, in canonical order."""
        return tuple(i.name for i in self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[MatrixItem]:
        return iter(self.items)

    def index(self, name: str) -> int:
        """Position of ``name`` in the canonical order."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"{name!r} is not an item of this plan") from None

    def item(self, name: str) -> MatrixItem:
        """The :class:`~dmuon.comm.MatrixItem` called ``name``."""
        return self.items[self.index(name)]

    def owner(self, name: str) -> int:
        """The rank (HSDP: the slot ``i·S + j``) that owns ``name``."""
        return self.owners[self.index(name)]

    def shard_owner(self, name: str) -> int:
        """HSDP: the shard index ``j`` of the owner (its rank in a shard group)."""
        return self.owner(name) % self.shard_size

    def replicate_owner(self, name: str) -> int:
        """HSDP: the replica index ``i`` of the owner (its rank in a replicate group)."""
        return self.owner(name) // self.shard_size

    def items_of(self, rank: int) -> tuple[MatrixItem, ...]:
        """The items ``rank`` owns, in canonical order."""
        self._check_rank(rank)
        return tuple(self.items[k] for k in self._by_rank.get(rank, ()))

    def names_of(self, rank: int) -> tuple[str, ...]:
        """Names of the items ``rank`` owns, in canonical order."""
        return tuple(i.name for i in self.items_of(rank))

    def load(self, rank: int) -> float:
        """``rank``'s load."""
        self._check_rank(rank)
        return self.loads[rank]

    def nbytes_of(self, rank: int) -> int:
        """Bytes of the items ``rank`` owns."""
        return sum(i.nbytes for i in self.items_of(rank))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")

    # -- balance ---------------------------------------------------------------

    @property
    def max_load(self) -> float:
        """Largest per-rank load (what the step waits for)."""
        return max(self.loads)

    @property
    def total_load(self) -> float:
        """Sum of the per-rank loads."""
        return sum(self.loads)

    def imbalance(self) -> float:
        """``max / mean − 1`` of the per-rank loads (0 for a perfect balance).

        Examples:
            >>> from dmuon.comm import MatrixItem, plan_owners
            >>> plan = plan_owners([MatrixItem("a", (8, 8)), MatrixItem("b", (8, 8))], 2)
            >>> plan.imbalance()
            0.0
        """
        mean = self.total_load / self.world_size
        return max(0.0, self.max_load / mean - 1.0) if mean > 0 else 0.0

    # -- identity --------------------------------------------------------------

    def digest(self) -> str:
        """SHA-256 (hex) of what the collectives depend on.

        Covers the world and replicate sizes and, per item in canonical order, its
        name, shape, dtype, layer and owner. Strategy, solver and loads are left out:
        two plans that move the same bytes between the same ranks are compatible.

        Examples:
            >>> from dmuon.comm import MatrixItem, plan_owners
            >>> a = plan_owners([MatrixItem("w", (4, 4))], 2)
            >>> b = plan_owners([MatrixItem("w", (4, 4))], 2, strategy="round_robin")
            >>> a.digest() == b.digest(), len(a.digest())
            (True, 64)
        """
        payload = {
            "format": 1,
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "items": [
                [i.name, list(i.shape), str(i.dtype), i.layer, o]
                for i, o in zip(self.items, self.owners, strict=True)
            ],
        }
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def summary(self, max_rows: int = 16) -> str:
        """A human-readable table: per rank, its load, items and bytes.

        Examples:
            >>> from dmuon.comm import MatrixItem, plan_owners
            >>> print(plan_owners([MatrixItem("w", (4, 4))], 1).summary())  # doctest: +ELLIPSIS
            OwnerPlan: 1 items on 1 ranks, strategy lpt (lpt), imbalance 0.0%, digest ...
            rank  load (rel. to mean)  items  MiB  first items
               0               1.000      1  0.0  w
        """
        mean = self.total_load / self.world_size if self.world_size else 0.0
        hsdp = f" as {self.replicate_size}×{self.shard_size} (replicate×shard)"
        lines = [
            f"OwnerPlan: {len(self.items)} items on {self.world_size} ranks"
            f"{hsdp if self.replicate_size > 1 else ''}, strategy {self.strategy} "
            f"({self.solver}), imbalance {100 * self.imbalance():.1f}%, "
            f"digest {self.digest()[:12]}",
            "rank  load (rel. to mean)  items  MiB  first items",
        ]
        for rank in range(min(self.world_size, max_rows)):
            names = self.names_of(rank)
            rel = self.loads[rank] / mean if mean > 0 else 0.0
            shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
            lines.append(
                f"{rank:>4}  {rel:>18.3f}  {len(names):>5}  "
                f"{self.nbytes_of(rank) / 2**20:>3.1f}  {shown}"
            )
        if self.world_size > max_rows:
            lines.append(f"… {self.world_size - max_rows} more ranks")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return (
            f"OwnerPlan({len(self.items)} items, world_size={self.world_size}, "
            f"replicate_size={self.replicate_size}, strategy={self.strategy!r}, "
            f"solver={self.solver!r}, imbalance={self.imbalance():.4f}, "
            f"digest={self.digest()[:12]!r})"
        )
