"""Owner assignment as a mixed-integer program (scipy's HiGHS), under batching.

Interchangeable units are aggregated, which keeps the program small enough to
solve to optimality in about a second for real models (a binary per unit and rank
does not: HiGHS stalls far from the bound on a 12-layer GPT over 8 ranks).

* A unit's *type* is its shape composition (how many matrices of each shape it
  holds) and its cost; units of one type are interchangeable.
* Layers of the same-layer constraint with the same multiset of unit types form a
  *group* ``g`` of ``L_g`` layers with ``m_{g,t}`` units of type ``t`` each and cap
  ``c_g = ceil(k_g / N)`` units per rank and layer. Units without such a layer form
  one unconstrained group.

Variables: ``n[g, t, r] ∈ ℕ`` units of type ``t`` of group ``g`` on rank ``r``; for
every shape ``s`` batched calls on rank ``r`` — ``k[s, r] ∈ ℕ`` calls when the call
cost is affine in the batch size (``C(s, b) = o_s + b·c_s``, the default model),
else ``x[s, b, r] ∈ ℕ`` calls of exactly ``b`` matrices; ``L`` the maximum load::

    Σ_r n[g, t, r] = m_{g,t}·L_g                       every unit has an owner
    Σ_t n[g, t, r] ≤ c_g·L_g                           same-layer constraint (see below)
    B·k[s, r] ≥ count_{s,r}   or   Σ_b b·x[s, b, r] = count_{s,r}
    load_r = Σ c_s·count_{s,r} + o_s·k[s, r]   (or Σ C(s, b)·x[s, b, r]) ≤ L

where ``count_{s,r} = Σ_{g,t} n[g, t, r]·(matrices of shape s in type t) + h_{s,r}``,
``h_{s,r}`` the matrices of shape ``s`` rank ``r`` holds outside the plan (``held``: its
experts), which share its batched calls as the engine runs them. Stage 1
minimises ``L``; stage 2 keeps ``L`` and minimises the total work ``Σ_r load_r``
(fewer, fuller batched calls). This is the objective of DMuon's profiled ILP
(Chen et al., *Efficient Distributed Muon Training with Near-Adam Overhead*, 2026:
integer batch counts per shape, size and rank; min-max, then min-total).

The same-layer constraint is exact in aggregate form: in group ``g``, join type
copies (each type ``t`` split into ``m_{g,t}`` copies of degree ``L_g``) to rank
copies (each rank split into ``c_g`` copies of degree ≤ ``L_g``) by one edge per
unit. The bipartite multigraph has maximum degree ``L_g``, so by König's
edge-colouring theorem its edges take ``L_g`` colours with no two edges of one
colour at a node; colour ``ℓ`` is layer ``ℓ``, which then gets every unit it holds
and at most ``c_g`` of them per rank. :func:`edge_colouring` builds that colouring
(alternating-path recolouring).
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dmuon.comm.cost import Costing, ShapeKey, shape_key
from dmuon.comm.items import MatrixItem
from dmuon.comm.owner_plan import natural_key
from dmuon.comm.units import Unit

__all__ = ["edge_colouring", "scipy_milp_available", "solve_owner_ilp"]

TypeKey = tuple[tuple[tuple[ShapeKey, int], ...], float]


def scipy_milp_available() -> bool:
    """True when ``scipy.optimize.milp`` can be imported."""
    try:
        if importlib.util.find_spec("scipy") is None:
            return False
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _Group:
    layers: list[list[int]]  # per layer, its unit indices (canonical order)
    types: list[int]  # type indices present
    mult: dict[int, int]  # units of each type per layer (constrained) or in total (free)
    cap: int | None  # units per rank and layer; None for the unconstrained group
    free_units: dict[int, list[int]] = field(default_factory=dict)


def _model(units: Sequence[Unit], caps: dict[str, int], costing: Costing):
    batched = costing.batch_cost is not None
    type_index: dict[TypeKey, int] = {}
    comps: list[dict[ShapeKey, int]] = []
    unit_type: list[int] = []
    for unit in units:
        comp: dict[ShapeKey, int] = {}
        if batched:
            for item in unit.items:
                comp[shape_key(item)] = comp.get(shape_key(item), 0) + item.batch
        key: TypeKey = (tuple(sorted(comp.items())), 0.0 if batched else unit.cost)
        if key not in type_index:
            type_index[key] = len(type_index)
            comps.append(comp)
        unit_type.append(type_index[key])

    by_layer: dict[str, list[int]] = {}
    free: dict[int, list[int]] = {}
    for u, unit in enumerate(units):
        if unit.layer is not None and unit.layer in caps:
            by_layer.setdefault(unit.layer, []).append(u)
        else:
            free.setdefault(unit_type[u], []).append(u)
    by_signature: dict[tuple[int, ...], list[list[int]]] = {}
    for layer in sorted(by_layer, key=natural_key):
        members = by_layer[layer]
        by_signature.setdefault(tuple(sorted(unit_type[u] for u in members)), []).append(members)
    groups = []
    for signature, layers in by_signature.items():
        mult: dict[int, int] = {}
        for t in signature:
            mult[t] = mult.get(t, 0) + 1
        cap = caps[units[layers[0][0]].layer]  # type: ignore[index]
        groups.append(_Group(layers, sorted(mult), mult, cap))
    if free:
        groups.append(_Group([], sorted(free), {t: len(us) for t, us in free.items()}, None, free))
    return unit_type, comps, groups


def solve_owner_ilp(
    units: Sequence[Unit],
    world_size: int,
    caps: dict[str, int],
    costing: Costing,
    time_limit: float,
    gap: float,
    held: Sequence[Sequence[MatrixItem]] | None = None,
) -> tuple[list[int], str] | None:
    """Owners per unit and a status word, or None if the solver found nothing.

    ``held[r]``: the matrices rank ``r`` steps outside the plan. Under batched costs they
    count in ``count_{s,r}`` (a planned matrix of their shape joins their calls);
    otherwise their cost is a constant of the rank's load.

    ``time_limit`` counts from the call, model building included: building grows with
    the model (it took minutes for 2k matrices of distinct widths before it was made
    linear), and the caller's budget is for the whole plan. If building uses it all, the
    result is None, as when the solver finds nothing in time.
    """
    start = time.monotonic()
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    N = world_size
    if not units:
        return [], "optimal"
    unit_type, comps, groups = _model(units, caps, costing)
    batched = costing.batch_cost is not None
    held = held if held is not None else [[] for _ in range(N)]
    # the load held outside the plan: batched, its matrices per shape and rank (h_{s,r});
    # else a constant per rank
    held_count: dict[ShapeKey, list[int]] = {}
    const = [0.0] * N
    for r, its in enumerate(held):
        if batched:
            for item in its:
                held_count.setdefault(shape_key(item), [0] * N)[r] += item.batch
        else:
            const[r] = costing.rank_load(its)
    classes: list[ShapeKey] = sorted({s for comp in comps for s in comp} | set(held_count))
    type_cost = [0.0] * len(comps)
    if not batched:
        for u, t in enumerate(unit_type):
            type_cost[t] = units[u].cost

    n_vars = 0

    def new_var() -> int:
        nonlocal n_vars
        n_vars += 1
        return n_vars - 1

    rows: list[tuple[dict[int, float], float, float]] = []
    n_var: dict[tuple[int, int, int], int] = {}
    for g, group in enumerate(groups):
        size = len(group.layers) if group.cap is not None else 1
        for t in group.types:
            for r in range(N):
                n_var[(g, t, r)] = new_var()
            total = float(group.mult[t] * size)
            rows.append(({n_var[(g, t, r)]: 1.0 for r in range(N)}, total, total))
        if group.cap is not None:
            limit = float(group.cap * len(group.layers))
            for r in range(N):
                rows.append(({n_var[(g, t, r)]: 1.0 for t in group.types}, -np.inf, limit))

    # count_{s,r} as a linear form: the n variables of rank r whose type holds shape s,
    # in n_var's order (one pass; a scan of n_var per (s, r) made building quadratic)
    count_of: dict[tuple[ShapeKey, int], dict[int, float]] = {}
    for (_g, t, r), k in n_var.items():
        for s, c in comps[t].items():
            if c:
                count_of.setdefault((s, r), {})[k] = float(c)

    # Per-rank load as a linear form, in units scaled to O(1) (HiGHS tolerances are absolute).
    raw_loads: list[dict[int, float]] = [{} for _ in range(N)]
    B = costing.max_batch
    of_type = [0] * len(comps)  # units of each type over all groups
    for group in groups:
        size = len(group.layers) if group.cap is not None else 1
        for t, m in group.mult.items():
            of_type[t] += m * size
    totals = {s: sum(held_count.get(s, ())) for s in classes}
    for t, comp in enumerate(comps):
        for s, c in comp.items():
            totals[s] += c * of_type[t]
    upper: dict[int, float] = {}
    for s in classes:
        sizes = list(range(1, min(B, totals[s]) + 1))
        calls = [costing.call_cost(s, b) for b in sizes]
        per_matrix = calls[1] - calls[0] if len(calls) > 1 else calls[0]
        overhead = calls[0] - per_matrix
        affine = overhead >= 0 and all(
            math.isclose(c, overhead + b * per_matrix, rel_tol=1e-9, abs_tol=1e-15)
            for b, c in zip(sizes, calls, strict=True)
        )
        for r in range(N):
            count = count_of.get((s, r), {})
            h = float(held_count[s][r]) if s in held_count else 0.0
            if affine:
                k = new_var()
                upper[k] = float(-(-totals[s] // B))
                rows.append(({k: float(B), **{v: -c for v, c in count.items()}}, h, np.inf))
                raw_loads[r][k] = raw_loads[r].get(k, 0.0) + overhead
                for v, c in count.items():
                    raw_loads[r][v] = raw_loads[r].get(v, 0.0) + per_matrix * c
                const[r] += per_matrix * h
            else:
                coef: dict[int, float] = {}
                for b, cost in zip(sizes, calls, strict=True):
                    x = new_var()
                    upper[x] = float(-(-totals[s] // b))
                    coef[x] = float(b)
                    raw_loads[r][x] = cost
                rows.append(({**coef, **{v: -c for v, c in count.items()}}, h, h))
    if not batched:
        for (_g, t, r), k in n_var.items():
            raw_loads[r][k] = type_cost[t]
    scale = max((abs(c) for load in raw_loads for c in load.values()), default=1.0) or 1.0
    loads = [{k: c / scale for k, c in load.items()} for load in raw_loads]
    L = new_var()
    for r in range(N):
        rows.append(({**loads[r], L: -1.0}, -np.inf, -const[r] / scale))

    data: list[float] = []
    ri: list[int] = []
    ci: list[int] = []
    for i, (row, _, _) in enumerate(rows):
        for column, value in row.items():
            ri.append(i)
            ci.append(column)
            data.append(value)
    A = coo_array((data, (ri, ci)), shape=(len(rows), n_vars)).tocsr()
    constraints = LinearConstraint(A, [lo for _, lo, _ in rows], [hi for _, _, hi in rows])
    integrality = np.ones(n_vars)
    integrality[L] = 0
    ub = np.full(n_vars, np.inf)
    for column, bound in upper.items():
        ub[column] = bound
    left = time_limit - (time.monotonic() - start)
    if left <= 0:
        return None
    options: dict[str, Any] = {"time_limit": left, "mip_rel_gap": gap, "disp": False}
    c1 = np.zeros(n_vars)
    c1[L] = 1.0
    res = milp(
        c1, integrality=integrality, bounds=Bounds(0, ub), constraints=constraints, options=options
    )
    if res.x is None:
        return None
    status = "optimal" if res.status == 0 else "time limit"
    solution = res.x
    remaining = time_limit - (time.monotonic() - start)
    if batched and remaining > 0.05 and status == "optimal":
        c2 = np.zeros(n_vars)
        for load in loads:
            for column, value in load.items():
                c2[column] += value
        ub2 = ub.copy()
        ub2[L] = res.x[L] * (1 + 1e-9) + 1e-12
        res2 = milp(
            c2,
            integrality=integrality,
            bounds=Bounds(0, ub2),
            constraints=constraints,
            options={**options, "time_limit": remaining},
        )
        if res2.x is not None:
            solution = res2.x
        if res2.status != 0:
            status = "max load optimal, total work not proven" if status == "optimal" else status
    counts = {key: round(float(solution[k])) for key, k in n_var.items()}
    return _realise(units, unit_type, groups, counts, N), status


def _realise(
    units: Sequence[Unit],
    unit_type: Sequence[int],
    groups: Sequence[_Group],
    counts: dict[tuple[int, int, int], int],
    N: int,
) -> list[int]:
    """Concrete owners from per-(group, type, rank) counts."""
    owners = [-1] * len(units)
    for g, group in enumerate(groups):
        if group.cap is None:
            for t in group.types:
                ranks = [r for r in range(N) for _ in range(counts[(g, t, r)])]
                for u, r in zip(group.free_units[t], ranks, strict=True):
                    owners[u] = r
            continue
        n_layers, cap = len(group.layers), group.cap
        left: dict[tuple[int, int], int] = {}
        for t in group.types:
            for j in range(group.mult[t]):
                left[(t, j)] = len(left)
        edges: list[tuple[int, int]] = []
        edge_type: list[tuple[int, int]] = []
        used_by_rank = [0] * N
        for t in group.types:
            made = 0
            for r in range(N):
                for _ in range(counts[(g, t, r)]):
                    copy = made // n_layers
                    right = r * cap + used_by_rank[r] // n_layers
                    edges.append((left[(t, copy)], right))
                    edge_type.append((t, copy))
                    used_by_rank[r] += 1
                    made += 1
        colours = edge_colouring(edges, len(left), N * cap, n_layers)
        for (t, copy), (_, right), layer in zip(edge_type, edges, colours, strict=True):
            of_type = [u for u in group.layers[layer] if unit_type[u] == t]
            owners[of_type[copy]] = right // cap
    assert all(o >= 0 for o in owners), "every unit gets an owner"
    return owners


def edge_colouring(
    edges: Sequence[tuple[int, int]], n_left: int, n_right: int, n_colours: int
) -> list[int]:
    """Colour the edges of a bipartite multigraph with ``n_colours`` ≥ max degree colours.

    No two edges that share a node get the same colour (König: max degree colours
    suffice for a bipartite graph). For each edge ``(u, v)`` take a colour ``a`` free at
    ``u`` and ``b`` free at ``v``; if ``a`` is taken at ``v``, swap ``a`` and ``b`` along
    the alternating path from ``v`` (in a bipartite graph it cannot reach ``u``), then
    colour the edge ``a``.

    Examples:
        >>> edge_colouring([(0, 0), (0, 1), (1, 0), (1, 1)], 2, 2, 2)
        [1, 0, 0, 1]
    """
    at_left: list[dict[int, int]] = [{} for _ in range(n_left)]
    at_right: list[dict[int, int]] = [{} for _ in range(n_right)]
    colour = [-1] * len(edges)
    for e, (u, v) in enumerate(edges):
        a = next(c for c in range(n_colours) if c not in at_left[u])
        b = next(c for c in range(n_colours) if c not in at_right[v])
        if a in at_right[v]:
            # Walk v -a- u1 -b- v2 -a- ... and swap a <-> b on the path.
            path: list[int] = []
            node, side, want = v, "right", a
            while True:
                table = at_right[node] if side == "right" else at_left[node]
                nxt = table.get(want)
                if nxt is None:
                    break
                path.append(nxt)
                pu, pv = edges[nxt]
                node, side = (pu, "left") if side == "right" else (pv, "right")
                want = b if want == a else a
            for p in path:
                pu, pv = edges[p]
                del at_left[pu][colour[p]]
                del at_right[pv][colour[p]]
            for p in path:
                pu, pv = edges[p]
                colour[p] = b if colour[p] == a else a
                at_left[pu][colour[p]] = p
                at_right[pv][colour[p]] = p
        colour[e] = a
        at_left[u][a] = e
        at_right[v][a] = e
    return colour
