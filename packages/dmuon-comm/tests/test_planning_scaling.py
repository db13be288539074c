"""Planning scales with the model: LPT's refinement and the ILP's time limit.

The refinement after LPT scanned every (unit on the loaded rank, unit elsewhere) pair
each round — 17 s for 8k matrices on 2 ranks, moving nothing — and now finds each
unit's best partner by bisection. It must choose exactly what the scan chose: the
property test below runs the scan, kept verbatim as ``_refine_by_scan``, against it.
The ILP's ``ilp_time_limit`` started after the model was built, and building took
minutes for 2k matrices; the clock now starts when the solve does.

Nothing here measures time: the scaling test counts cost reads, the time-limit tests
run a fake clock.
"""

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon.comm.ilp as ilp
from dmuon.comm import MatrixItem, plan_owners, planning
from dmuon.comm.cost import Costing
from dmuon.comm.units import Unit, layer_caps, make_units


def _refine_by_scan(
    units: Sequence[Unit],
    owners: list[int],
    world_size: int,
    caps: dict[str, int],
    base: Sequence[float],
) -> list[int]:
    """The refinement as it was (verbatim): the reference the fast one must equal."""
    owners = list(owners)
    loads = list(base)
    held: list[list[int]] = [[] for _ in range(world_size)]
    per_layer: dict[str, list[int]] = {}
    for u, r in enumerate(owners):
        loads[r] += units[u].cost
        held[r].append(u)
        layer = units[u].layer
        if layer in caps:
            per_layer.setdefault(layer, [0] * world_size)[r] += 1

    def fits(u: int, src: int, dst: int, leaving: int | None) -> bool:
        layer = units[u].layer
        if layer not in caps:
            return True
        count = per_layer[layer][dst]
        if leaving is not None and units[leaving].layer == layer:
            count -= 1
        return count < caps[layer]

    for _ in range(20 * len(units) + 1):
        hi = max(range(world_size), key=lambda r: (loads[r], -r))
        best: tuple[float, int, int, int] | None = None  # (new pair max, u, dst, v or -1)
        for u in sorted(held[hi]):
            cu = units[u].cost
            for dst in range(world_size):
                if dst == hi:
                    continue
                if fits(u, hi, dst, None):
                    pair = max(loads[hi] - cu, loads[dst] + cu)
                    if pair < loads[hi] * (1 - 1e-12) and (best is None or pair < best[0]):
                        best = (pair, u, dst, -1)
                for v in sorted(held[dst]):
                    cv = units[v].cost
                    if cv >= cu or not fits(u, hi, dst, v) or not fits(v, dst, hi, u):
                        continue
                    pair = max(loads[hi] - cu + cv, loads[dst] + cu - cv)
                    if pair < loads[hi] * (1 - 1e-12) and (best is None or pair < best[0]):
                        best = (pair, u, dst, v)
        if best is None:
            break
        _, u, dst, v = best
        for unit, src, to in ((u, hi, dst), (v, dst, hi)):
            if unit < 0:
                continue
            owners[unit] = to
            held[src].remove(unit)
            held[to].append(unit)
            loads[src] -= units[unit].cost
            loads[to] += units[unit].cost
            layer = units[unit].layer
            if layer in caps:
                per_layer[layer][src] -= 1
                per_layer[layer][to] += 1
    return owners


# Costs from a small pool make ties (equal units, equal pair maxima) common; the
# fractions make float rounding decide some comparisons, as real second counts do.
COSTS = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 0.1, 0.2, 0.3, 1e-9, 1e9]),
    st.floats(0, 100, allow_nan=False, allow_infinity=False),
    st.integers(0, 6).map(float),
)


@st.composite
def refinement_cases(draw):
    """Units, owners, world size, caps and held loads as ``plan_owners`` hands them to
    ``_refine`` (owners from LPT), or owners drawn at random (which may break the caps:
    the two must agree there too)."""
    world_size = draw(st.integers(1, 16))
    n = draw(st.integers(0, 40))
    layers = draw(st.lists(st.sampled_from(["a", "b", "c", "d", None]), min_size=n, max_size=n))
    costs = draw(st.lists(COSTS, min_size=n, max_size=n))
    units = [
        Unit(f"u{i}", (MatrixItem(f"u{i}", (4, 4), layer=layer),), layer, cost)
        for i, (layer, cost) in enumerate(zip(layers, costs, strict=True))
    ]
    caps = layer_caps(units, world_size) if draw(st.booleans()) else {}
    base = (
        draw(st.lists(COSTS, min_size=world_size, max_size=world_size))
        if draw(st.booleans())
        else [0.0] * world_size
    )
    if draw(st.booleans()):
        owners = planning._lpt(units, world_size, world_size, caps, base)
    else:
        owners = draw(st.lists(st.integers(0, world_size - 1), min_size=n, max_size=n))
    return units, owners, world_size, caps, base


@settings(max_examples=600, deadline=None)
@given(refinement_cases())
def test_refinement_chooses_what_the_pairwise_scan_chose(case):
    units, owners, world_size, caps, base = case
    expected = _refine_by_scan(units, owners, world_size, caps, base)
    assert planning._refine(units, owners, world_size, caps, base) == expected


@st.composite
def models(draw):
    """Layered models with repeated shapes (equal costs) and some unlayered matrices."""
    shapes = [(64, 64), (16, 64), (256, 64), (64, 256), (32, 32)]
    items = []
    for i in range(draw(st.integers(0, 6))):
        for j, shape in enumerate(draw(st.lists(st.sampled_from(shapes), max_size=7))):
            items.append(MatrixItem(f"layers.{i}.m{j}", shape, layer=f"layers.{i}"))
    for j, shape in enumerate(draw(st.lists(st.sampled_from(shapes), max_size=4))):
        items.append(MatrixItem(f"head.{j}", shape))
    return items


@settings(max_examples=200, deadline=None)
@given(
    models(),
    st.integers(1, 16),
    st.sampled_from([0, 2048, 1 << 20]),
    st.booleans(),
    st.booleans(),
)
def test_plans_equal_those_of_the_pairwise_scan(
    items, world_size, pack_below, spread_layers, measured
):
    # measured: costs by name with ties and float fractions instead of the batched model
    cost = {i.name: float(i.numel % 7) / 3 for i in items} if measured else None
    kwargs = {"pack_below": pack_below, "spread_layers": spread_layers, "cost": cost}
    plan = plan_owners(items, world_size, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planning, "_refine", _refine_by_scan)
        reference = plan_owners(items, world_size, **kwargs)
    assert plan.owners == reference.owners
    assert plan.loads == reference.loads


class _CountedUnit:
    """A unit that counts reads of its cost (the refinement reads only cost and layer)."""

    reads = 0

    def __init__(self, cost: float, layer: str | None) -> None:
        self._cost, self.layer = cost, layer

    @property
    def cost(self) -> float:
        _CountedUnit.reads += 1
        return self._cost


def test_a_refinement_round_reads_each_cost_a_bounded_number_of_times():
    # 2000 units of 400 layers on 2 ranks, LPT-balanced, so refinement moves nothing: the
    # scan read costs once per (u, v) pair (about n²/4 = 1e6 reads), a round now reads
    # each once. 10 reads per unit leaves room for bookkeeping, none for a pair scan.
    n, world_size = 2000, 2
    plain = [
        Unit(f"u{i}", (MatrixItem(f"u{i}", (4, 4)),), f"layer{i // 5}", float(1 + i % 5))
        for i in range(n)
    ]
    caps = layer_caps(plain, world_size)
    owners = planning._lpt(plain, world_size, world_size, caps, [0.0, 0.0])
    counted = [_CountedUnit(u.cost, u.layer) for u in plain]
    _CountedUnit.reads = 0
    assert planning._refine(counted, owners, world_size, caps, [0.0, 0.0]) == owners  # type: ignore[arg-type]
    assert _CountedUnit.reads <= 10 * n


class _FakeClock:
    """``time.monotonic`` for ``dmuon.comm.ilp`` that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _slow_model_build(monkeypatch, seconds: float) -> None:
    """Model building (``ilp._model``) takes ``seconds`` on a fake clock."""
    clock = _FakeClock()
    monkeypatch.setattr(ilp, "time", clock)
    model = ilp._model

    def slow(*args, **kwargs):
        clock.now += seconds
        return model(*args, **kwargs)

    monkeypatch.setattr(ilp, "_model", slow)


def _gpt(layers: int) -> list[MatrixItem]:
    shapes = {"attn": (64, 192), "fc": (256, 64), "proj": (64, 256)}
    return [
        MatrixItem(f"h.{i}.{p}", s, layer=f"h.{i}")
        for i in range(layers)
        for p, s in shapes.items()
    ]


def test_ilp_time_limit_counts_model_building(monkeypatch):
    # Building outlasts the limit: the solver is not started and the LPT plan stays,
    # as when a solve runs out of time.
    _slow_model_build(monkeypatch, seconds=5.0)
    items = _gpt(4)
    costing = Costing(items, None, None, 8)
    units = make_units(items, costing, 0)
    assert ilp.solve_owner_ilp(units, 4, layer_caps(units, 4), costing, 2.0, 1e-3) is None
    plan = plan_owners(items, 4, strategy="ilp", ilp_time_limit=2.0)
    assert plan.solver == "lpt (ilp found no solution in time)"
    assert plan.owners == plan_owners(items, 4).owners


def test_ilp_solver_gets_only_the_time_building_left(monkeypatch):
    _slow_model_build(monkeypatch, seconds=3.0)
    given: list[float] = []
    import scipy.optimize

    milp = scipy.optimize.milp

    def recorded(*args, options, **kwargs):
        given.append(options["time_limit"])
        return milp(*args, options=options, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", recorded)
    plan = plan_owners(_gpt(4), 4, strategy="ilp", ilp_time_limit=10.0)
    assert plan.solver.startswith(("ilp", "lpt (ilp"))
    assert given and given[0] == pytest.approx(7.0)  # 10 s less the 3 s of building
