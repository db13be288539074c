"""plan_owners: give every matrix one owner rank, balancing Newton–Schulz cost."""

from __future__ import annotations

import bisect
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from dmuon.comm.cost import Costing, CostSpec, NSCost, ShapeKey
from dmuon.comm.items import MatrixItem
from dmuon.comm.owner_plan import OwnerPlan, OwnerUnit, natural_key
from dmuon.comm.units import Unit, layer_caps, make_units

__all__ = ["DEFAULT_PACK_BELOW", "STRATEGIES", "plan_owners"]

STRATEGIES = ("lpt", "round_robin", "single", "ilp")
"""Values of ``plan_owners(strategy=...)``."""

# Matrices of one layer with fewer elements than this are packed into one unit:
# one owner, one bucket, one collective (e.g. the k and v projections of a GQA
# layer). 2**20 elements is 4 MiB in fp32; DMuon uses 5M for 7B-scale models.
DEFAULT_PACK_BELOW = 1 << 20
"""Default ``pack_below``: matrices of one layer with fewer elements share one owner unit."""


def plan_owners(
    items: Iterable[MatrixItem],
    world_size: int,
    *,
    strategy: str = "lpt",
    cost: CostSpec = None,
    batch_cost: Callable[[ShapeKey, int], float] | None = None,
    max_batch: int = 8,
    pack_below: int = DEFAULT_PACK_BELOW,
    spread_layers: bool = True,
    refine: bool = True,
    replicate_size: int = 1,
    ilp_time_limit: float = 10.0,
    ilp_gap: float = 1e-3,
    held: Sequence[Sequence[MatrixItem]] | None = None,
) -> OwnerPlan:
    """Assign every matrix to exactly one owner rank, balancing the owners' work.

    **Units.** The items of one layer (same ``layer`` key) with fewer than
    ``pack_below`` elements are packed into one unit with one owner (one bucket,
    one collective); every other item is a unit of its own.

    **Cost.** By default (``cost=None``) a unit costs the estimated seconds of its
    Newton–Schulz call(s): FLOPs of the method that will run plus a byte term and a
    per-call overhead (:class:`~dmuon.comm.NSCost`). Same-shape matrices on one rank
    share batched calls of up to ``max_batch`` matrices, which the loads account
    for. A caller can pass its own :class:`~dmuon.comm.NSCost`, a function of the
    :class:`~dmuon.comm.MatrixItem`, a mapping ``name → measured cost``, or a
    ``batch_cost(shape_key, b)`` giving the measured cost of one batched call of
    ``b`` matrices of shape ``shape_key = (rows, cols, dtype)``.

    **Strategies.**

    * ``"lpt"`` (default): longest processing time first — units in decreasing cost
      (ties by name) each go to the least-loaded allowed rank (ties: fewer units,
      then lower rank; Graham's bound without constraints and with additive costs:
      max load ≤ 4/3 of the optimum) — then, with ``refine``, a local search that
      moves or swaps units off the most loaded rank while that lowers the maximum
      (greedy placement under the same-layer constraint can strand a layer's last
      units). Both place by each unit's own cost: under batched costs, where the
      call overhead dominates, they can spread same-shape matrices one batched
      call would take (three 256×128 and one 64×64 on 3 ranks: 1.9× the
      optimum); ``"ilp"`` models the batching.
    * ``"ilp"``: a mixed-integer program (scipy's HiGHS via
      :func:`scipy.optimize.milp`) that minimises the maximum per-rank load and then
      the total work, with same-shape matrices batched per rank. It is given
      ``ilp_time_limit`` seconds; the LPT plan is kept if the solver finds nothing
      better, and used outright (with a warning) when scipy is not installed
      (``pip install "dmuon-comm[ilp]"``).
    * ``"round_robin"``: units in name order to ranks ``0, 1, …`` (ablation).
    * ``"single"``: everything on rank 0 (ablation; single-process runs).

    **Same-layer constraint** (``spread_layers``): a rank holds at most
    ``ceil(k / world_size)`` of the ``k`` units of a layer, so when there are at
    least as many ranks as units every unit of a layer has a different owner and
    the layer's broadcasts run concurrently. ``round_robin`` and ``single`` ignore
    it.

    **Load held outside the plan** (``held``): ``held[r]`` lists the matrices rank
    ``r`` steps itself whatever the plan says — the experts of a stack split over an
    expert-parallel mesh dimension, which each rank orthogonalises where they live.
    They are costed like the items and start each rank's load, so LPT, its
    refinement and the ILP place the planned matrices around them (a rank with more
    experts gets fewer dense matrices), and :attr:`~dmuon.comm.OwnerPlan.loads`
    includes them (batched with the rank's planned matrices of the same shape). The
    plan's items and owners do not include them.

    **HSDP.** With ``replicate_size = R`` the ``world_size = R·S`` ranks are the
    slots ``i·S + j`` of an (replicate, shard) mesh; LPT breaks ties by the load of
    the shard column ``j`` so that the shard groups stay balanced too. The plan
    records ``R`` for the two-stage reduction of :func:`~dmuon.comm.reduce_to_owners`.

    The result is a pure function of the arguments, independent of the order of
    ``items`` (names must be unique): every rank gets the same plan without
    communicating. The one exception is ``strategy="ilp"``: ``ilp_time_limit`` is
    wall-clock time, so ranks slowed differently — on one machine too, by CPU
    contention — can stop the solver at different points and plan different owners.
    :func:`~dmuon.comm.plan_adoption.adopt_first_plan` then gives every rank the first rank's plan
    (``dedicate()`` and DMuon's own modes call it);
    :func:`~dmuon.comm.check_plan_consistency` detects plans that still differ.

    Args:
        items: the matrices; names must be unique.
        world_size: number of ranks (for HSDP the total ``R·S``).
        strategy: one of :data:`STRATEGIES`.
        cost: cost of the items, see above.
        batch_cost: measured cost of one batched call, see above.
        max_batch: most matrices per batched Newton–Schulz call.
        pack_below: element count below which same-layer items are packed; 0
            disables packing.
        spread_layers: apply the same-layer constraint.
        refine: run the local search after LPT (``False``: plain LPT, for ablations).
        replicate_size: ``R`` for HSDP; 1 otherwise.
        ilp_time_limit: seconds (wall clock) the ILP may take, building the program
            included.
        ilp_gap: relative optimality gap at which the ILP solver stops.
        held: per rank, the matrices it steps outside the plan (``world_size`` lists;
            names unique among them and the items).

    Returns:
        The :class:`~dmuon.comm.OwnerPlan`.

    Raises:
        ValueError: duplicate or invalid items, a bad ``world_size``,
            ``replicate_size``, ``strategy``, ``max_batch``, ``pack_below``,
            ``ilp_time_limit`` or ``ilp_gap`` (a number ≥ 0), ``spread_layers`` or
            ``refine`` not a bool, ``held`` not one list per rank, or a cost that is not a
            number (a mapping's value, a function's result) or is missing, negative or
            not finite.

    Examples:
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> items = [
        ...     MatrixItem(f"h.{i}.{p}", shape, layer=f"h.{i}")
        ...     for i in range(4)
        ...     for p, shape in [("attn", (768, 2304)), ("fc", (3072, 768)), ("proj", (768, 3072))]
        ... ]
        >>> plan = plan_owners(items, 4)
        >>> plan.owner("h.0.fc") != plan.owner("h.0.proj")  # same layer, different owners
        True
        >>> plan.imbalance() < 0.05
        True
    """
    items = _check_items(items)
    _check_int("world_size", world_size, 1)
    _check_int("replicate_size", replicate_size, 1)
    _check_int("max_batch", max_batch, 1)
    _check_int("pack_below", pack_below, 0)
    if world_size % replicate_size:
        raise ValueError(
            f"world_size ({world_size}) must be a multiple of replicate_size ({replicate_size}): "
            "HSDP ranks form a replicate_size × shard_size mesh"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not _is_real(ilp_time_limit) or not ilp_time_limit > 0:
        raise ValueError(f"ilp_time_limit must be > 0 seconds, got {ilp_time_limit!r}")
    if not _is_real(ilp_gap) or not ilp_gap >= 0:
        # scipy's HiGHS only warns ("Invalid option value") and runs with its default gap
        raise ValueError(
            f"ilp_gap must be a relative gap ≥ 0 (e.g. 1e-3: stop within 0.1% of the "
            f"optimum; inf: at the first solution found), got {ilp_gap!r}"
        )
    for flag, value in (("spread_layers", spread_layers), ("refine", refine)):
        if not isinstance(value, bool):
            # a string such as "no" is truthy: it would have turned the option on
            raise ValueError(f"{flag} must be True or False, got {value!r}")

    kept = _check_held(held, world_size, items)
    cost = _checked_cost(cost, [*items, *(i for its in kept for i in its)])
    costing = Costing([*items, *(i for its in kept for i in its)], cost, batch_cost, max_batch)
    base = [costing.rank_load(its) for its in kept]
    units = make_units(items, costing, pack_below)
    caps = layer_caps(units, world_size) if spread_layers else {}
    shard_size = world_size // replicate_size
    solver = strategy

    if strategy == "single":
        owners = [0] * len(units)
    elif strategy == "round_robin":
        ordered = sorted(range(len(units)), key=lambda u: natural_key(units[u].items[0].name))
        owners = [0] * len(units)
        for position, u in enumerate(ordered):
            owners[u] = position % world_size
    else:
        owners = _lpt(units, world_size, shard_size, caps, base)
        if refine:
            owners = _refine(units, owners, world_size, caps, base)
        solver = "lpt"
        if strategy == "ilp":
            owners, solver = _ilp_or_lpt(
                units, owners, world_size, caps, costing, ilp_time_limit, ilp_gap, kept
            )
    return _build_plan(
        items, units, owners, costing, world_size, replicate_size, strategy, solver, kept
    )


def _check_held(
    held: Sequence[Sequence[MatrixItem]] | None, world_size: int, items: Sequence[MatrixItem]
) -> list[list[MatrixItem]]:
    """``held`` as one sorted list per rank, checked: one list per rank, MatrixItems, names
    unique among them and the items."""
    if held is None:
        return [[] for _ in range(world_size)]
    if isinstance(held, (str, bytes, Mapping)) or not isinstance(held, Iterable):
        raise ValueError(
            f"held must be None or one list of MatrixItems per rank ({world_size} lists), got "
            f"{type(held).__name__}: {held!r}"
        )
    held = list(held)
    for r, its in enumerate(held):
        if isinstance(its, (str, bytes, Mapping, MatrixItem)) or not isinstance(its, Iterable):
            raise ValueError(
                f"held[{r}] must be a list of the MatrixItems rank {r} steps outside the plan "
                f"([] for none), got {type(its).__name__}: {its!r}"
            )
    kept = [list(its) for its in held]
    if len(kept) != world_size:
        raise ValueError(
            f"held must give one list of matrices per rank ({world_size}), got {len(kept)}"
        )
    names = {i.name for i in items}
    for r, its in enumerate(kept):
        for item in its:
            if not isinstance(item, MatrixItem):
                raise ValueError(
                    f"held[{r}] must hold MatrixItem objects, got {type(item).__name__}"
                )
            if item.name in names:
                raise ValueError(
                    f"held[{r}]: {item.name!r} is named twice (in the items or another "
                    "rank's held matrices); a matrix is planned or held by one rank, once"
                )
            names.add(item.name)
    return [sorted(its, key=lambda i: natural_key(i.name)) for its in kept]


def _is_real(value: object) -> bool:
    """A real number that is not a bool (int, float, numpy's)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_cost(value: object) -> bool:
    """A cost: a real number (not a bool or a string, which ``float()`` would have read as
    ``1.0`` or parsed), or a 0-d tensor of one."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return _is_real(value)


def _checked_cost(cost: CostSpec, items: Sequence[MatrixItem]) -> CostSpec:
    """``cost`` with its values checked: a mapping's entries for ``items`` must be numbers
    (``{"a": "1"}`` was read as 1.0), and a function's results too (``None`` or ``"x"``
    ended in ``float()``'s error, which named neither ``cost`` nor the item). Everything
    else is left to :class:`~dmuon.comm.cost.Costing`, which refuses what is not a cost."""
    if cost is None or isinstance(cost, NSCost):
        return cost
    if isinstance(cost, Mapping):
        bad = {i.name: cost[i.name] for i in items if i.name in cost and not _is_cost(cost[i.name])}
        if bad:
            raise ValueError(
                f"cost: the mapping's costs must be numbers (seconds, or any one unit), got "
                f"{dict(list(bad.items())[:3])}"
            )
        return cost
    if callable(cost):
        fn = cost

        def checked(item: MatrixItem) -> float:
            value = fn(item)
            if not _is_cost(value):
                raise ValueError(
                    f"cost: the cost function must return a number (seconds, or any one unit) "
                    f"for each MatrixItem, got {value!r} for item {item.name!r}"
                )
            return value

        return checked
    return cost


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int ≥ {low}, got {value!r}")


def _check_items(items: Iterable[MatrixItem]) -> list[MatrixItem]:
    out = list(items)
    for item in out:
        if not isinstance(item, MatrixItem):
            raise ValueError(
                f"items must be MatrixItem objects, got {type(item).__name__}: {item!r}"
            )
    seen: set[str] = set()
    dups = sorted({i.name for i in out if i.name in seen or seen.add(i.name)})  # type: ignore[func-returns-value]
    if dups:
        raise ValueError(f"item names must be unique; repeated: {dups[:5]}")
    return sorted(out, key=lambda i: natural_key(i.name))


def _lpt(
    units: Sequence[Unit],
    world_size: int,
    shard_size: int,
    caps: dict[str, int],
    base: Sequence[float],
) -> list[int]:
    """Greedy longest-processing-time assignment with deterministic tie-breaks, from the
    loads ``base`` the ranks hold outside the plan."""
    loads = list(base)
    column_loads = [0.0] * shard_size
    for r, load in enumerate(base):
        column_loads[r % shard_size] += load
    counts = [0] * world_size
    per_layer: dict[str, list[int]] = {}
    owners = [0] * len(units)
    for u in sorted(range(len(units)), key=lambda k: units[k].key):
        unit = units[u]
        cap = caps.get(unit.layer) if unit.layer is not None else None
        taken = (
            per_layer.setdefault(unit.layer, [0] * world_size)
            if cap and unit.layer is not None
            else None
        )
        candidates = [r for r in range(world_size) if taken is None or taken[r] < (cap or 0)]
        rank = min(
            candidates,
            key=lambda r: (loads[r], column_loads[r % shard_size], counts[r], r),
        )
        owners[u] = rank
        loads[rank] += unit.cost
        column_loads[rank % shard_size] += unit.cost
        counts[rank] += 1
        if taken is not None:
            taken[rank] += 1
    return owners


def _refine(
    units: Sequence[Unit],
    owners: list[int],
    world_size: int,
    caps: dict[str, int],
    base: Sequence[float],
) -> list[int]:
    """Local search after LPT: move or swap units off the most loaded rank.

    Greedy LPT under the same-layer constraint can strand the last units of a layer
    with only loaded ranks allowed (a 12.5%–25% imbalance on a model with as many
    layers as ranks). Each round takes the most loaded rank and applies the move of
    one of its units to another rank, or the swap with a cheaper unit there, that
    lowers the larger of the two loads the most, within the layer caps; it stops
    when nothing lowers the maximum. Deterministic, and never worse than its input.

    Among equally good changes it takes the first in the order (unit ``u`` on the
    loaded rank, destination rank, the move, then the swap partners ``v``), all by
    index. Scanning every ``(u, v)`` pair made a round quadratic in the units (17 s for
    8k matrices on 2 ranks), so a round instead sorts each rank's candidate partners by
    cost once and finds, per ``(u, dst)``, the best ``v`` by bisection: the new pair
    maximum ``max(L_hi − c_u + c_v, L_dst + c_u − c_v)`` falls then rises in ``c_v`` (in
    floating point too: rounding is monotone), so its minimum over a sorted list sits at
    the crossing, and the partners that tie with it form a run around it, in which the
    lowest index is taken as the scan did.
    """
    owners = list(owners)
    loads = list(base)
    n = len(units)
    cost = [unit.cost for unit in units]
    # a unit's layer if the same-layer constraint caps it, else None
    layer_of = [unit.layer if unit.layer in caps else None for unit in units]
    per_layer: dict[str, list[int]] = {}
    for u, r in enumerate(owners):
        loads[r] += cost[u]
        layer = layer_of[u]
        if layer is not None:
            per_layer.setdefault(layer, [0] * world_size)[r] += 1
    by_cost = sorted(range(n), key=lambda u: (cost[u], u))
    members: dict[str, list[int]] = {}  # each capped layer's units by (cost, index)
    for u in by_cost:
        layer = layer_of[u]
        if layer is not None:
            members.setdefault(layer, []).append(u)

    for _ in range(20 * n + 1):
        hi = max(range(world_size), key=lambda r: (loads[r], -r))
        # Swap partners valid whatever u is, when u itself may join dst: those whose layer
        # may grow on hi. A partner of u's own layer leaves room for u on dst and u leaves
        # room for it on hi, so those are a list of their own per (layer, rank).
        free: list[tuple[list[float], list[int]]] = [([], []) for _ in range(world_size)]
        blocked = {layer for layer, on in per_layer.items() if on[hi] >= caps[layer]}
        for v in by_cost:
            r = owners[v]
            if r != hi and layer_of[v] not in blocked:
                _add_partner(free[r], cost[v], v)
        same: dict[tuple[str, int], tuple[list[float], list[int]]] = {}  # filled as asked
        # A change is taken if its new pair maximum is below `bar`: the round's limit and
        # then the best so far (ties keep the first). Costs are ≥ 0 and float rounding is
        # monotone, so moving u to dst (pair max(a, b)) or swapping it for a v there
        # (max(a + c_v, b - c_v), 0 ≤ c_v < c_u) gives at least max(a, b - c_u): when that
        # reaches `bar`, the pair is skipped unsearched.
        best: tuple[int, int, int] | None = None  # (u, dst, v or -1)
        bar = loads[hi] * (1 - 1e-12)
        for u in range(n):
            if owners[u] != hi:
                continue
            cu, layer = cost[u], layer_of[u]
            a = loads[hi] - cu
            if a >= bar:
                continue
            for dst in range(world_size):
                if dst == hi:
                    continue
                b = loads[dst] + cu
                if b - cu >= bar:
                    continue
                trades = False
                if layer is None:
                    joins = True
                else:
                    cap, on_dst = caps[layer], per_layer[layer][dst]
                    joins = on_dst < cap  # u may join dst without a unit of its layer leaving
                    trades = on_dst - 1 < cap and per_layer[layer][hi] - 1 < cap
                swap = None
                if joins:
                    pair = max(a, b)
                    if pair < bar:
                        bar, best = pair, (u, dst, -1)
                    swap = _best_partner(free[dst], a, b, cu)
                if trades and layer is not None:
                    if (layer, dst) not in same:
                        partners: tuple[list[float], list[int]] = ([], [])
                        for v in members[layer]:
                            if owners[v] == dst:
                                _add_partner(partners, cost[v], v)
                        same[(layer, dst)] = partners
                    other = _best_partner(same[(layer, dst)], a, b, cu)
                    if other is not None and (swap is None or other < swap):
                        swap = other
                if swap is not None and swap[0] < bar:
                    bar, best = swap[0], (u, dst, swap[1])
        if best is None:
            break
        u, dst, v = best
        for unit, src, to in ((u, hi, dst), (v, dst, hi)):
            if unit < 0:
                continue
            owners[unit] = to
            loads[src] -= cost[unit]
            loads[to] += cost[unit]
            layer = layer_of[unit]
            if layer is not None:
                per_layer[layer][src] -= 1
                per_layer[layer][to] += 1
    return owners


def _add_partner(partners: tuple[list[float], list[int]], c: float, v: int) -> None:
    """Append ``v`` of cost ``c`` to ``(distinct costs, lowest index of each)``, fed by
    increasing ``(cost, index)``."""
    costs, first = partners
    if not costs or costs[-1] != c:
        costs.append(c)
        first.append(v)


def _best_partner(
    partners: tuple[list[float], list[int]], a: float, b: float, cu: float
) -> tuple[float, int] | None:
    """The lowest ``max(a + c_v, b − c_v)`` over the partners cheaper than ``cu``, and the
    lowest index that reaches it; None if no partner is cheaper.

    ``a + c`` never falls and ``b − c`` never rises as ``c`` grows (float rounding is
    monotone), so the maximum is ``b − c`` before the first cost ``p`` where
    ``a + c ≥ b − c`` and ``a + c`` from there on: the minimum is at ``p`` or just
    before it, and the costs that tie with it are one run around it.
    """
    costs, first = partners
    k = bisect.bisect_left(costs, cu)
    if k == 0:
        return None
    lo, up = 0, k
    while lo < up:
        mid = (lo + up) // 2
        if a + costs[mid] >= b - costs[mid]:
            up = mid
        else:
            lo = mid + 1
    # below lo the maximum is b - c, from lo on it is a + c
    if lo == k:
        value, start, end = b - costs[k - 1], k - 1, k - 1
    elif lo == 0:
        value, start, end = a + costs[0], 0, 0
    else:
        below, above = b - costs[lo - 1], a + costs[lo]
        value = min(below, above)
        start = lo - 1 if below == value else lo
        end = lo if above == value else lo - 1
    while start > 0 and b - costs[start - 1] == value:
        start -= 1
    while end + 1 < k and a + costs[end + 1] == value:
        end += 1
    return value, min(first[start : end + 1])


def _ilp_or_lpt(
    units: Sequence[Unit],
    lpt_owners: list[int],
    world_size: int,
    caps: dict[str, int],
    costing: Costing,
    time_limit: float,
    gap: float,
    kept: Sequence[Sequence[MatrixItem]],
) -> tuple[list[int], str]:
    from dmuon.comm.ilp import scipy_milp_available, solve_owner_ilp

    if not scipy_milp_available():
        warnings.warn(
            "strategy='ilp' needs scipy (pip install 'dmuon-comm[ilp]'); "
            "falling back to the LPT plan",
            RuntimeWarning,
            stacklevel=3,
        )
        return lpt_owners, "lpt (ilp fallback: scipy not installed)"
    solution = solve_owner_ilp(units, world_size, caps, costing, time_limit, gap, kept)
    if solution is None:
        return lpt_owners, "lpt (ilp found no solution in time)"
    owners, status = solution

    def score(assignment: list[int]) -> tuple[float, float]:
        loads = _rank_loads(units, assignment, costing, world_size, kept)
        return max(loads), sum(loads)

    ilp_max, ilp_total = score(owners)
    lpt_max, lpt_total = score(lpt_owners)
    tol = 1e-9 * max(lpt_max, 1e-300)
    if ilp_max < lpt_max - tol or (ilp_max <= lpt_max + tol and ilp_total < lpt_total - tol):
        return owners, f"ilp ({status})"
    return lpt_owners, f"lpt (ilp {status}, no better than lpt)"


def _rank_loads(
    units: Sequence[Unit],
    owners: Sequence[int],
    costing: Costing,
    world_size: int,
    kept: Sequence[Sequence[MatrixItem]],
) -> list[float]:
    per_rank: list[list[MatrixItem]] = [list(its) for its in kept]
    for unit, owner in zip(units, owners, strict=True):
        per_rank[owner].extend(unit.items)
    return [costing.rank_load(sorted(its, key=lambda i: natural_key(i.name))) for its in per_rank]


def _build_plan(
    items: Sequence[MatrixItem],
    units: Sequence[Unit],
    owners: Sequence[int],
    costing: Costing,
    world_size: int,
    replicate_size: int,
    strategy: str,
    solver: str,
    kept: Sequence[Sequence[MatrixItem]],
) -> OwnerPlan:
    owner_of = {i.name: o for u, o in zip(units, owners, strict=True) for i in u.items}
    return OwnerPlan(
        items=tuple(items),
        owners=tuple(owner_of[i.name] for i in items),
        units=tuple(
            OwnerUnit(u.name, tuple(i.name for i in u.items), u.layer, u.cost, o)
            for u, o in zip(units, owners, strict=True)
        ),
        loads=tuple(_rank_loads(units, owners, costing, world_size, kept)),
        world_size=world_size,
        replicate_size=replicate_size,
        strategy=strategy,
        solver=solver,
    )
