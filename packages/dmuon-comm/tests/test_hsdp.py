"""HSDP: owners on an R × S (replicate, shard) mesh, two-stage reduce and broadcast."""

import itertools

import pytest
import torch
import torch.distributed as dist

from dmuon.comm import (
    CollectiveInputError,
    CommStats,
    MatrixItem,
    broadcast_from_owners,
    make_buckets,
    plan_owners,
    reduce_to_owners,
)
from dmuon.comm.testing import run_on_ranks

ITEMS = [MatrixItem(f"h.{i}.{p}", (6 + i, 4), layer=f"h.{i}") for i in range(3) for p in "abc"]


def mesh_groups(R, S):
    """This rank's shard group (ranks i·S + 0..S−1) and replicate group (j, S + j, …)."""
    shard = [dist.new_group([i * S + j for j in range(S)]) for i in range(R)]
    replicate = [dist.new_group([i * S + j for i in range(R)]) for j in range(S)]
    rank = dist.get_rank()
    return shard[rank // S], replicate[rank % S]


def grad(name, rank):
    g = torch.Generator().manual_seed(hash(name) % 1000 + 97 * rank)
    return torch.randn(next(i.shape for i in ITEMS if i.name == name), generator=g)


@pytest.mark.parametrize(("R", "S"), [(2, 2), (2, 3)])
def test_two_stage_reduce_equals_the_average_over_all_ranks(R, S):
    def body(rank, n):
        shard_group, replicate_group = mesh_groups(R, S)
        plan = plan_owners(ITEMS, n, replicate_size=R)
        buckets = make_buckets(plan)
        for b in buckets:
            b.pack({name: grad(name, rank) for name in b.names})
        stats = CommStats()
        owned = reduce_to_owners(
            buckets, plan, group=shard_group, replicate_group=replicate_group, stats=stats
        ).wait()
        assert sorted(owned) == sorted(plan.names_of(rank))
        for name, got in owned.items():
            expected = torch.stack([grad(name, r).double() for r in range(n)]).mean(0)
            assert ((got.double() - expected).abs() <= 1e-6 * (1 + expected.abs())).all()
        mine = rank % S
        second = sum(1 for b in buckets if b.owner % S == mine)
        assert stats["reduce_to_owners"].collectives == len(buckets) + second
        P = sum(i.nbytes for i in ITEMS)
        stage_two = sum(b.nbytes for b in buckets if b.owner % S == mine)
        expected_sent = (S - 1) / S * P + (R - 1) / R * stage_two
        assert stats["reduce_to_owners"].bytes_sent == pytest.approx(expected_sent)
        return sorted(owned)

    owned = run_on_ranks(body, R * S, timeout=60)
    assert sorted(itertools.chain(*owned)) == sorted(i.name for i in ITEMS)


def test_two_stage_broadcast_round_trips():
    R, S = 2, 2

    def body(rank, n):
        shard_group, replicate_group = mesh_groups(R, S)
        plan = plan_owners(ITEMS, n, replicate_size=R)
        buckets = make_buckets(plan)
        for b in buckets:
            if b.owner == rank:
                b.pack({name: grad(name, 1000 + rank) for name in b.names})
        got = broadcast_from_owners(
            buckets, plan, group=shard_group, replicate_group=replicate_group
        ).wait()
        for name in plan.names:
            assert torch.equal(got[name], grad(name, 1000 + plan.owner(name)))

    run_on_ranks(body, R * S, timeout=60)


def test_an_hsdp_plan_needs_both_groups_of_the_right_sizes():
    def body(rank, n):
        shard_group, replicate_group = mesh_groups(2, 2)
        plan = plan_owners(ITEMS, 4, replicate_size=2)
        buckets = make_buckets(plan)
        errors = []
        for kwargs in (
            {"group": shard_group},
            {"group": replicate_group, "replicate_group": None},
            {"group": None, "replicate_group": replicate_group},
        ):
            try:
                reduce_to_owners(buckets, plan, **kwargs)
            except ValueError as exc:
                errors.append(str(exc))
        return errors

    for errors in run_on_ranks(body, 4, timeout=60):
        assert "pass the shard group as group= and the replicate group" in errors[0]
        assert "pass the shard group as group=" in errors[1]
        assert "group has 4 ranks and replicate_group has 2" in errors[2]


def test_verify_reaches_every_rank_of_the_mesh():
    # Rank 3's buckets do not match the plan; the agreement runs over the shard
    # group and then the replicate group, so ranks 0 and 1 (other shard group) learn
    # it too and nobody enters the two-stage reduction.
    def body(rank, n):
        shard_group, replicate_group = mesh_groups(2, 2)
        plan = plan_owners(ITEMS, n, replicate_size=2)
        buckets = make_buckets(plan)
        if rank == 3:
            buckets = buckets[1:]
        with pytest.raises(CollectiveInputError) as info:
            reduce_to_owners(
                buckets, plan, group=shard_group, replicate_group=replicate_group, verify=True
            )
        ok = reduce_to_owners(
            make_buckets(plan), plan, group=shard_group, replicate_group=replicate_group
        ).wait()
        return str(info.value), sorted(ok)

    for message, _ in run_on_ranks(body, 4, timeout=60):
        assert "ranks [3] call it with a different plan, layout or arguments" in message
