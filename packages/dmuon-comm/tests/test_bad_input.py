"""Bad input: a clear error on every rank, never a hang, and the group stays usable."""

import pytest
import torch
import torch.distributed as dist

from dmuon.comm import (
    CollectiveInputError,
    MatrixItem,
    PlanMismatchError,
    all_gather_updates,
    check_plan_consistency,
    make_buckets,
    plan_owners,
    reduce_to_owners,
    shard_all_to_all,
    shard_range,
)
from dmuon.comm.testing import run_on_ranks

ITEMS = [MatrixItem(f"h.{i}.{p}", (5, 3), layer=f"h.{i}") for i in range(3) for p in "ab"]


def shards_for(plan, n, rank):
    return {
        i.name: torch.ones(shard_range(i.shape[0], n, rank)[1], *i.shape[1:]) for i in plan.items
    }


def error_text(fn):
    """Run ``fn``; return ``"Type: message"`` of what it raises, or None."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_mismatched_owners_across_ranks_raise_on_every_rank():
    def body(rank, n):
        strategy = "single" if rank == 1 else "lpt"  # rank 1 plans differently
        plan = plan_owners(ITEMS, n, strategy=strategy)
        with pytest.raises(PlanMismatchError) as info:
            check_plan_consistency(plan)
        return str(info.value), info.value.digests

    results = run_on_ranks(body, 3, timeout=60)
    for message, digests in results:
        assert "owner plans differ across ranks" in message
        assert "ranks [0, 2]" in message and "ranks [1]" in message
        assert "the items agree but the owners differ" in message
        assert sorted(digests) == [0, 1, 2] and digests[0] == digests[2] != digests[1]


def test_mismatched_items_and_world_sizes_raise_on_every_rank():
    def body(rank, n):
        items = ITEMS if rank != 2 else [*ITEMS[:-1], MatrixItem("h.2.b", (3, 5), layer="h.2")]
        bad_items = error_text(lambda: check_plan_consistency(plan_owners(items, n)))
        world = 2 if rank == 0 else n  # rank 0 planned for the wrong world size
        bad_world = error_text(lambda: check_plan_consistency(plan_owners(ITEMS, world)))
        good = check_plan_consistency(plan_owners(ITEMS, n))  # the group still works
        return bad_items, bad_world, good

    results = run_on_ranks(body, 3, timeout=60)
    for bad_items, bad_world, good in results:
        assert bad_items.startswith("PlanMismatchError") and "the items differ" in bad_items
        assert "ranks [0] hold a plan for a world size other than the group's 3" in bad_world
        assert good == results[0][2]


def test_shapes_that_disagree_with_the_plan_raise_before_any_transfer():
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        shards = shards_for(plan, n, rank)
        shards["h.0.a"] = torch.ones(5, 3)  # the full matrix instead of this rank's shard
        message = error_text(lambda: shard_all_to_all(shards, plan))
        bucket = make_buckets(plan)[0]
        pack = error_text(lambda: bucket.pack({k: torch.ones(3, 5) for k in bucket.names}))
        # Nothing was started, so the next collective runs normally.
        full = shard_all_to_all(shards_for(plan, n, rank), plan).wait()
        assert all(torch.equal(t, torch.ones(5, 3)) for t in full.values())
        return message, pack

    for rank, (message, pack) in enumerate(run_on_ranks(body, 3, timeout=60)):
        length = shard_range(5, 3, rank)[1]
        assert message == (
            f"ValueError: shard_all_to_all: rank {rank}'s shard of 'h.0.a' (global shape (5, 3)) "
            f"must have shape ({length}, 3) (rows {2 * rank}:{2 * rank + length} under "
            f"torch.chunk over 3 ranks), got (5, 3)"
        )
        assert "has shape (3, 5), but the plan and bucket say (5, 3)" in pack


def test_a_bad_input_on_one_rank_raises_on_every_rank_with_verify():
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        shards = shards_for(plan, n, rank)
        if rank == 1:
            shards["h.1.b"] = shards["h.1.b"].double()  # only rank 1 is wrong
        with pytest.raises(CollectiveInputError) as info:
            shard_all_to_all(shards, plan, verify=True)
        err = info.value
        full = shard_all_to_all(shards_for(plan, n, rank), plan, verify=True).wait()
        return str(err), err.bad_ranks, sorted(full)

    for rank, (message, bad, owned) in enumerate(run_on_ranks(body, 3, timeout=60)):
        assert bad == [1]
        assert "shard_all_to_all: the ranks' inputs do not go together" in message
        assert (
            "rank 1: ValueError: shard_all_to_all: shard of 'h.1.b' has dtype torch.float64"
            in message
        )
        assert owned == sorted(plan_owners(ITEMS, 3).names_of(rank))


def test_buckets_from_another_plan_on_one_rank_are_caught_with_verify():
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        other = plan_owners(ITEMS, n, strategy="single")
        buckets = make_buckets(other if rank == 0 else plan)
        for b in buckets:
            b.buffer.fill_(1.0)
        try:
            reduce_to_owners(buckets, plan, verify=True)
        except (CollectiveInputError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return None

    for name, message in run_on_ranks(body, 3, timeout=60):
        assert name == "CollectiveInputError"
        assert "ranks [0] call it with a different plan, layout or arguments" in message
        assert "rank 0: ValueError: reduce_to_owners:" in message
        assert "but the plan's owner is rank" in message


def test_a_process_group_of_the_wrong_size():
    def body(rank, n):
        pair = dist.new_group([0, 1])
        if rank == 2:
            return None
        plan = plan_owners(ITEMS, 3)  # planned for the world, called on a pair
        message = error_text(lambda: reduce_to_owners(make_buckets(plan), plan, group=pair))
        gather = error_text(lambda: all_gather_updates({}, plan, group=pair))
        return message, gather

    results = run_on_ranks(body, 3, timeout=60)
    for message, gather in results[:2]:
        assert message == (
            "ValueError: reduce_to_owners: the process group has 2 ranks but the plan was made "
            "for world_size=3; plan for this group's size or pass the group the plan is for"
        )
        assert "the process group has 2 ranks but the plan was made for world_size=3" in gather


def test_average_of_integers_and_unknown_ops_are_rejected():
    def body(rank, n):
        plan = plan_owners([MatrixItem("i", (2, 2), torch.int32)], n)
        buckets = make_buckets(plan)
        avg = error_text(lambda: reduce_to_owners(buckets, plan))
        op = error_text(lambda: reduce_to_owners(buckets, plan, op="max"))
        for b in buckets:
            b.buffer.fill_(rank + 1)
        total = reduce_to_owners(buckets, plan, op="sum").wait()
        return avg, op, total

    results = run_on_ranks(body, 2, timeout=60)
    for avg, op, _ in results:
        assert "op='avg' needs floating-point buckets, got torch.int32" in avg
        assert "op must be 'avg' or 'sum'" in op
    owner = plan_owners([MatrixItem("i", (2, 2), torch.int32)], 2).owner("i")
    assert torch.equal(results[owner][2]["i"], torch.full((2, 2), 3, dtype=torch.int32))


def test_check_buckets_names_each_mismatch_as_the_collectives_do():
    """What ``reduce_to_owners``/``broadcast_from_owners`` check per call unless
    ``checked=True``: ``check_buckets`` raises the same errors, and passes the buckets
    ``make_buckets`` made from the plan."""
    from dmuon.comm import FlatBucket, broadcast_from_owners, check_buckets

    plan = plan_owners(ITEMS, 2)
    check_buckets(plan, make_buckets(plan))
    owner = plan.owner("h.0.a")

    def bucket(shapes, owner=owner):
        return FlatBucket(shapes, dtype=torch.float32, owner=owner)

    cases = {
        "not an item": ([bucket([("zz", (5, 3))])], "bucket tensor 'zz' is not an item"),
        "shape": ([bucket([("h.0.a", (3, 5))])], "'h.0.a' has shape (3, 5) but the plan says"),
        "owner": ([bucket([("h.0.a", (5, 3))], 1 - owner)], "the plan's owner is rank"),
        "twice": ([bucket([("h.0.a", (5, 3))])] * 2, "'h.0.a' is in more than one bucket"),
        "rank": ([bucket([("h.0.a", (5, 3))], 7)], "a bucket has owner 7, outside [0, 2)"),
    }
    for case, (buckets, text) in cases.items():
        with pytest.raises(ValueError, match=r"^check_buckets: ") as err:
            check_buckets(plan, buckets)
        assert text in str(err.value), (case, str(err.value))
    # the collectives check the same (on a one-rank plan: no group needed)
    one = plan_owners(ITEMS, 1)
    bad = [FlatBucket([("h.0.a", (3, 5))], dtype=torch.float32, owner=0)]
    for collective in (reduce_to_owners, broadcast_from_owners):
        message = error_text(lambda c=collective: c(bad, one))
        assert message is not None and "'h.0.a' has shape (3, 5) but the plan says" in message
