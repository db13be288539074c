"""adopt_first_plan: ranks whose plans differ only in their owners take the first rank's.

An ILP solve runs under a wall-clock limit, so ranks slowed differently plan different
owners for one model; a rank whose *items* differ is another model, which must still be
reported as such by the check that follows.
"""

import pytest
import torch.distributed as dist
from model_lists import gpt_items

import dmuon.comm.ilp
import dmuon.comm.plan_adoption
from dmuon.comm import MatrixItem, PlanMismatchError, check_plan_consistency, plan_owners
from dmuon.comm.objects import broadcast_object
from dmuon.comm.plan_adoption import adopt_first_plan
from dmuon.comm.testing import run_on_ranks

ITEMS = [MatrixItem(f"h.{i}.{p}", (5, 3), layer=f"h.{i}") for i in range(3) for p in "ab"]


class LateClock:
    """A clock that jumps a million seconds at each read: to the ILP every time limit has
    run out as soon as it starts, so it skips its second stage (the total work), as on a
    rank slowed down by the others."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1e6
        return self.now


def ilp_plan(world: int, late: bool, replicate_size: int = 1):
    """The ILP plan of a 3-layer GPT (d = 8), with the solver's clock late or not."""
    saved = dmuon.comm.ilp.time
    if late:
        dmuon.comm.ilp.time = LateClock()
    try:
        return plan_owners(
            gpt_items(3, 8), world, strategy="ilp", pack_below=0, replicate_size=replicate_size
        )
    finally:
        dmuon.comm.ilp.time = saved


def test_a_late_clock_changes_the_ilp_plan():
    # what the tests below rely on: the plans differ in their owners only
    early, late = ilp_plan(3, False), ilp_plan(3, True)
    assert early.items == late.items and early.owners != late.owners


def test_ilp_plans_that_differ_between_ranks_become_the_first_ranks():
    def body(rank, n):
        mine = ilp_plan(n, late=rank == 1)
        plan = adopt_first_plan(mine)
        check_plan_consistency(plan)  # raised before: the owners differed
        return mine.digest(), plan.digest(), plan.solver, plan.items == mine.items

    results = run_on_ranks(body, 3, timeout=120)
    assert results[1][0] != results[0][0]  # rank 1 did plan otherwise
    for _, digest, solver, same_items in results:
        assert digest == results[0][0] and solver == ilp_plan(3, False).solver
        assert same_items  # each rank keeps its own items


def test_a_rank_with_other_items_keeps_its_plan_and_the_check_says_the_items_differ():
    def body(rank, n):
        items = ITEMS if rank != 2 else [*ITEMS[:-1], MatrixItem("h.2.b", (3, 5), layer="h.2")]
        strategy = "single" if rank == 1 else "lpt"  # rank 1: other owners only
        mine = plan_owners(items, n, strategy=strategy)
        plan = adopt_first_plan(mine)
        with pytest.raises(PlanMismatchError) as info:
            check_plan_consistency(plan)
        return mine.digest(), plan.digest(), str(info.value)

    (d0, p0, m0), (d1, p1, _), (d2, p2, _) = run_on_ranks(body, 3, timeout=60)
    assert d1 != d0 and p1 == p0  # rank 1 took rank 0's owners
    assert p2 == d2  # rank 2, another model, kept its plan
    assert "ranks [0, 1]" in m0 and "ranks [2]" in m0 and "the items differ" in m0


def test_agreeing_plans_exchange_only_the_fingerprints():
    def body(rank, n):
        def refuse(*args, **kwargs):
            raise AssertionError("nothing but the fingerprints should travel")

        dmuon.comm.plan_adoption.broadcast_object = refuse
        plan = plan_owners(ITEMS, n)
        return adopt_first_plan(plan) is plan

    assert run_on_ranks(body, 2, timeout=60) == [True, True]


def test_over_shard_then_replicate_groups_every_rank_takes_the_first_ranks_plan():
    # HSDP slots i·S + j on a 2 × 2 mesh: shard groups {0, 1}, {2, 3}, replicate groups
    # {0, 2}, {1, 3}. Rank 2 is first in its shard group but not in its replicate group:
    # its late plan spreads to rank 3 first, and rank 0's then replaces both.
    def body(rank, n):
        shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = ilp_plan(n, late=rank == 2, replicate_size=2)
        plan = adopt_first_plan(mine, [shards[rank // 2], replicas[rank % 2]])
        check_plan_consistency(plan)
        return mine.digest(), plan.digest()

    results = run_on_ranks(body, 4, timeout=120)
    assert results[2][0] != results[0][0]
    assert {digest for _, digest in results} == {results[0][0]}


def test_broadcast_object_sends_the_groups_first_rank_s_object():
    def body(rank, n):
        pair = dist.new_group([1, 2])
        world = broadcast_object({"from": rank})
        ours = broadcast_object(("rank", rank), pair) if rank in (1, 2) else None
        return world, ours

    results = run_on_ranks(body, 3, timeout=60)
    assert [w for w, _ in results] == [{"from": 0}] * 3
    assert [o for _, o in results] == [None, ("rank", 1), ("rank", 1)]
