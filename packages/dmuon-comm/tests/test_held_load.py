"""plan_owners(held=...): the planned matrices balanced around the load each rank holds itself.

Expert parallelism leaves each rank the experts it holds (a stack split over ``ep``
is orthogonalised where it lives); the owner plan then places the dense matrices
around that load. The reference is a brute force over every assignment of a small
instance under an additive cost (each matrix's cost a number, no batching), where
the optimum is known exactly.
"""

import itertools

import pytest

from dmuon.comm import MatrixItem, NSCost, plan_owners


def numel(item: MatrixItem) -> float:
    return float(item.numel)


def dense(k: int, size: int = 256) -> list[MatrixItem]:
    """``k`` dense matrices, one per layer (the same-layer cap does not bind)."""
    return [MatrixItem(f"h.{i}.w", (size, size), layer=f"h.{i}") for i in range(k)]


def brute_force(items, held, world, cost) -> float:
    """The smallest maximum load over every assignment of ``items`` to ``world`` ranks."""
    base = [sum(cost(i) for i in its) for its in held]
    best = float("inf")
    for owners in itertools.product(range(world), repeat=len(items)):
        loads = list(base)
        for item, r in zip(items, owners, strict=True):
            loads[r] += cost(item)
        best = min(best, max(loads))
    return best


def test_without_held_load_the_plan_is_unchanged():
    items = dense(9)
    for strategy in ("lpt", "round_robin"):
        plain = plan_owners(items, 3, strategy=strategy)
        empty = plan_owners(items, 3, strategy=strategy, held=[[], [], []])
        assert plain.owners == empty.owners and plain.loads == empty.loads


def test_a_rank_holding_experts_gets_fewer_dense_matrices_and_the_max_load_drops():
    """1024² matrices, where Newton–Schulz FLOPs dominate the cost: 8 dense matrices and
    4 experts on rank 0 balance as 2 + 4 experts against 6."""
    items = dense(8, 1024)
    held = [[MatrixItem("moe.w_in", (4, 1024, 1024), layer="moe")], []]
    plan = plan_owners(items, 2, held=held)
    assert [plan.owners.count(r) for r in range(2)] == [2, 6], plan.summary()
    assert plan.imbalance() < 0.01, plan.summary()
    assert "moe.w_in" not in plan.names  # held matrices are not planned
    # the plan that ignores the experts gives each rank 4 dense matrices: rank 0 then
    # runs 8 matrices (one batched call of 8), a third more than the balanced 6
    blind = plan_owners(items, 2)
    assert [blind.owners.count(r) for r in range(2)] == [4, 4]
    rank0_blind = NSCost().batch_seconds(1024, 1024, 4, 8)
    assert max(plan.loads) < 0.8 * rank0_blind, (plan.loads, rank0_blind)
    # the loads include the held experts, batched with the rank's dense matrices
    assert plan.loads[0] == pytest.approx(NSCost().batch_seconds(1024, 1024, 4, 6))


@pytest.mark.parametrize("strategy", ["lpt", "ilp"])
def test_max_load_against_the_brute_force_optimum(strategy):
    sizes = [64, 96, 128, 160, 64, 200, 32]
    items = [MatrixItem(f"d.{i}", (s, s), layer=f"d.{i}") for i, s in enumerate(sizes)]
    held = [
        [MatrixItem("e.0", (3, 128, 128))],
        [MatrixItem("e.1", (1, 128, 128))],
        [],
    ]
    optimum = brute_force(items, held, 3, numel)
    plan = plan_owners(items, 3, strategy=strategy, cost=numel, held=held)
    loads = [sum(numel(i) for i in its) for its in held]
    for name, owner in zip(plan.names, plan.owners, strict=True):
        loads[owner] += numel(next(i for i in items if i.name == name))
    assert list(plan.loads) == pytest.approx(loads)
    if strategy == "ilp":
        assert max(loads) == pytest.approx(optimum, rel=1e-6), (plan.solver, loads, optimum)
    else:  # LPT with its refinement: within Graham's 4/3 of the optimum
        assert max(loads) <= 4 / 3 * optimum, (loads, optimum)


@pytest.mark.parametrize("affine", [True, False], ids=["affine-calls", "measured-calls"])
def test_ilp_batches_planned_matrices_with_the_held_ones_of_their_shape(affine):
    """Under batched costs a planned matrix of a held matrix's shape joins that rank's
    batched call, as ``OwnerPlan.loads`` and the engine count it: the ILP must model it
    too. Here launch overhead dominates (1 ms a call): rank 0 holds a 256² matrix, so the
    two planned 256² matrices cost it almost nothing more, and the 128² one goes to rank
    1 beside its held 128² one. The ILP that took the held load as a constant split the
    256² pair (two calls on rank 1) at twice the optimum's maximum load."""
    cost = NSCost(call_overhead=1e-3)
    call = cost.batch_seconds
    items = [MatrixItem("a", (256, 256)), MatrixItem("b", (256, 256)), MatrixItem("c", (128, 128))]
    held = [[MatrixItem("e0", (256, 256))], [MatrixItem("e1", (128, 128))]]
    kwargs = (
        {"cost": cost}
        if affine
        else {
            # the same calls, measured (not affine in the batch size: a second matrix is free)
            "batch_cost": lambda key, b: (
                call(key[0], key[1], 4, 1) if b == 1 else call(key[0], key[1], 4, b) * 0.9
            )
        }
    )
    from dmuon.comm.cost import Costing

    costing = Costing([*items, *held[0], *held[1]], kwargs.get("cost"), kwargs.get("batch_cost"), 8)
    optimum = min(
        max(
            costing.rank_load(held[r] + [i for i, o in zip(items, owners, strict=True) if o == r])
            for r in range(2)
        )
        for owners in itertools.product(range(2), repeat=len(items))
    )
    plan = plan_owners(items, 2, strategy="ilp", held=held, **kwargs)
    assert plan.max_load == pytest.approx(optimum, rel=1e-6), (plan.summary(), optimum)
    assert plan.owners == (0, 0, 1), plan.summary()


def test_held_load_is_checked():
    items = dense(2)
    with pytest.raises(ValueError, match="one list of matrices per rank"):
        plan_owners(items, 2, held=[[]])
    with pytest.raises(ValueError, match=r"'h\.0\.w' is named twice"):
        plan_owners(items, 2, held=[[MatrixItem("h.0.w", (2, 8, 8))], []])
    with pytest.raises(ValueError, match=r"held\[1\] must hold MatrixItem"):
        plan_owners(items, 2, held=[[], ["moe.w"]])
