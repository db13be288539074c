"""Planning units: what :func:`~dmuon.comm.plan_owners` and the ILP give owners to.

A unit is one matrix, or the small matrices of one layer packed together (one
owner, one bucket, one collective). Shared by the greedy planner
(``planning.py``) and the integer program (``ilp.py``), which import it from here
so neither imports the other at module level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dmuon.comm.cost import Costing
from dmuon.comm.items import MatrixItem
from dmuon.comm.owner_plan import natural_key

__all__ = ["Unit", "layer_caps", "make_units"]


@dataclass
class Unit:
    """A planning unit before it has an owner: one matrix, or a layer's small ones packed."""

    name: str
    items: tuple[MatrixItem, ...]
    layer: str | None
    cost: float

    @property
    def key(self) -> tuple[float, tuple[tuple[tuple[int, int | str], ...], str]]:
        # Longest first; ties by name so that the order never depends on input order.
        return (-self.cost, natural_key(self.items[0].name))


def make_units(items: Sequence[MatrixItem], costing: Costing, pack_below: int) -> list[Unit]:
    """One unit per item, except the small items of one layer, packed into one."""
    by_layer: dict[str, list[MatrixItem]] = {}
    units: list[Unit] = []
    for item in items:  # canonical order
        if item.layer is not None and item.numel < pack_below:
            by_layer.setdefault(item.layer, []).append(item)
        else:
            units.append(Unit(item.name, (item,), item.layer, costing.item_cost[item.name]))
    for layer, small in by_layer.items():
        if len(small) == 1:
            (item,) = small
            units.append(Unit(item.name, (item,), layer, costing.item_cost[item.name]))
        else:
            # Packed items also share batched calls on their owner; the unit cost is
            # what LPT sorts by, the rank loads are recomputed with batching.
            cost = costing.rank_load(small)
            shown = ", ".join(i.name.removeprefix(layer).lstrip(".") for i in small)
            units.append(Unit(f"{layer}[packed: {shown}]", tuple(small), layer, cost))
    units.sort(key=lambda u: natural_key(u.items[0].name))
    return units


def layer_caps(units: Sequence[Unit], world_size: int) -> dict[str, int]:
    """Most units of one layer a rank may hold: ceil(k / world_size)."""
    counts: dict[str, int] = {}
    for u in units:
        if u.layer is not None:
            counts[u.layer] = counts.get(u.layer, 0) + 1
    return {layer: math.ceil(k / world_size) for layer, k in counts.items() if k > 1}
