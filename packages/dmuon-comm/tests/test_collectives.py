"""The collectives on real gloo process groups of 1, 2, 3 and 4 ranks.

Every rank generates every rank's input from a seed, so each rank can compute
the reference (an average in float64, the full matrix, the vote over the stacked
inputs) in a single process and compare it with what the collective delivered.
"""

import itertools
import math
import zlib

import pytest
import torch
import torch.distributed as dist

from dmuon.comm import (
    VOTES_PER_BYTE,
    CommStats,
    MatrixItem,
    all_gather_updates,
    broadcast_from_owners,
    cost_model,
    majority_vote,
    make_buckets,
    plan_owners,
    reduce_to_owners,
    shard_all_to_all,
    shard_all_to_all_reverse,
)
from dmuon.comm.testing import run_on_ranks

WORLD_SIZES = [1, 2, 3, 4]

# Uneven rows (3, 11 over 2–4 ranks), a single row (empty shards on every rank but
# one), a batch of matrices sharded on its leading dim, and a bf16 item.
ITEMS = [
    MatrixItem("h.0.wide", (3, 10), layer="h.0"),
    MatrixItem("h.0.tall", (11, 2), layer="h.0"),
    MatrixItem("h.1.row", (1, 5), layer="h.1"),
    MatrixItem("h.1.square", (6, 6), layer="h.1"),
    MatrixItem("experts", (3, 4, 2)),
    MatrixItem("half", (5, 4), torch.bfloat16),
]


def data(name: str, rank: int, dtype=torch.float32, shape=None) -> torch.Tensor:
    """What ``rank`` holds for ``name``: the same on every rank that asks."""
    item = next((i for i in ITEMS if i.name == name), None)
    shape = shape or item.shape
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(item.dtype if item else dtype)


def torch_chunk_shard(full: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """Reference sharding: torch.chunk along dim 0, as FSDP2 does; missing chunks are empty."""
    chunks = torch.chunk(full, n, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_to_owners_equals_a_single_process_average(world):
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        buckets = make_buckets(plan)
        for b in buckets:
            b.pack({name: data(name, rank) for name in b.names})
        owned = reduce_to_owners(buckets, plan).wait()
        assert sorted(owned) == sorted(plan.names_of(rank))
        for name, got in owned.items():
            expected = torch.stack([data(name, r).double() for r in range(n)]).mean(0)
            # fp32: a sum of ≤ 4 values then one division; bf16: 8-bit mantissa.
            tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-6
            assert ((got.double() - expected).abs() <= tol * (1 + expected.abs())).all(), name
        return sorted(owned)

    owned = run_on_ranks(body, world, timeout=60)
    assert sorted(itertools.chain(*owned)) == sorted(i.name for i in ITEMS)  # one owner each


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_to_owners_sum_is_exact_and_hands_back_views(world):
    def body(rank, n):
        plan = plan_owners(ITEMS[:5], n)
        buckets = make_buckets(plan)
        for b in buckets:
            for name in b.names:
                b.view(name).copy_(torch.full(plan.item(name).shape, float(rank + 1)))
        owned = reduce_to_owners(buckets, plan, op=dist.ReduceOp.SUM).wait()
        for name, got in owned.items():
            assert torch.equal(got, torch.full_like(got, n * (n + 1) / 2))
            bucket = next(b for b in buckets if name in b)
            assert got.data_ptr() == bucket.view(name).data_ptr()

    run_on_ranks(body, world, timeout=60)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_broadcast_from_owners_round_trips_the_owners_values(world):
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        buckets = make_buckets(plan)
        for b in buckets:
            if b.owner == rank:
                b.pack({name: data(name, 50 + rank) for name in b.names})
        # out= the model's own Parameters (leaves that need grad), as the README shows
        params = {i.name: torch.nn.Parameter(torch.zeros(i.shape, dtype=i.dtype)) for i in ITEMS}
        got = broadcast_from_owners(buckets, plan, out=params).wait()
        assert sorted(got) == sorted(plan.names)
        for name in plan.names:
            expected = data(name, 50 + plan.owner(name))
            assert torch.equal(got[name], expected) and torch.equal(params[name], expected)

    run_on_ranks(body, world, timeout=60)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_gather_updates_gives_every_rank_every_owners_update(world):
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        # Non-contiguous updates are fine: they are copied into the send buffer.
        updates = {name: data(name, 70 + rank).mT.contiguous().mT for name in plan.names_of(rank)}
        params = {"h.1.square": torch.nn.Parameter(torch.zeros(6, 6))}  # a leaf needing grad
        got = all_gather_updates(updates, plan, out=params).wait()
        assert sorted(got) == sorted(plan.names)
        for name in plan.names:
            assert torch.equal(got[name], data(name, 70 + plan.owner(name)))
        assert torch.equal(params["h.1.square"], got["h.1.square"])

    run_on_ranks(body, world, timeout=60)


def test_all_gather_updates_of_empty_items_only_fills_out_and_returns_them():
    """A plan whose every item of a dtype is empty (the empty tensor-parallel shards of a
    rank's column in replicated mode) sends nothing for it, and still hands back every
    item and fills ``out`` (it raised KeyError on the empty items)."""

    def body(rank, n):
        items = [MatrixItem("a", (0, 8)), MatrixItem("b", (5, 0)), MatrixItem("c", (2, 3))]
        items += [MatrixItem("d", (0, 3), torch.bfloat16)]
        plan = plan_owners(items, n)
        updates = {
            name: torch.full(plan.item(name).shape, 1.0 + rank, dtype=plan.item(name).dtype)
            for name in plan.names_of(rank)
        }
        out = {i.name: torch.zeros(i.shape, dtype=i.dtype) for i in items if i.name != "c"}
        got = all_gather_updates(updates, plan, out=out).wait()
        assert sorted(got) == ["a", "b", "c", "d"]
        assert {name: tuple(t.shape) for name, t in got.items()} == {i.name: i.shape for i in items}
        assert torch.equal(got["c"], torch.full((2, 3), 1.0 + plan.owner("c")))

    run_on_ranks(body, 2, timeout=60)


def test_shard_all_to_all_of_empty_items_only_hands_back_every_item_both_ways():
    """A dtype whose every item is empty (FSDP2 rows of a tensor-parallel shard of no
    columns: a (4, 1) matrix split over tp 2) sends nothing, and the owners still get
    their (empty) matrices and every rank its (empty) shards back; the items were left
    out of both results (sharded mode's KeyError, its tp peers waiting)."""

    def body(rank, n):
        items = [MatrixItem("a", (4, 0)), MatrixItem("b", (0, 3)), MatrixItem("c", (2, 3))]
        items += [MatrixItem("d", (2, 0), torch.bfloat16)]
        plan = plan_owners(items, n)
        full = {i.name: torch.full(i.shape, 3.0, dtype=i.dtype) for i in items}
        shards = {name: torch_chunk_shard(t, n, rank) for name, t in full.items()}
        gathered = shard_all_to_all(shards, plan).wait()
        assert sorted(gathered) == sorted(plan.names_of(rank))
        for name, t in gathered.items():
            assert t.shape == full[name].shape and t.dtype == full[name].dtype, name
        back = shard_all_to_all_reverse(gathered, plan).wait()
        assert sorted(back) == ["a", "b", "c", "d"]
        for name, t in back.items():
            assert t.shape == shards[name].shape and torch.equal(t, shards[name]), name

    run_on_ranks(body, 2, timeout=60)


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_fp16_average_does_not_overflow_where_the_mean_is_finite(replicas):
    """Two ranks (or 2 × 2 under HSDP) each hold 40000 in fp16 (largest 65504): the sum
    overflowed to inf before the division; the mean is 40000 (DDP divides first). An
    fp32 bucket beside it still divides the sum (bitwise what it gave)."""

    def body(rank, n):
        shard, replicate = None, None
        if replicas > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (replicas, n // replicas), mesh_dim_names=("r", "s"))
            shard, replicate = mesh["s"].get_group(), mesh["r"].get_group()
        items = [MatrixItem("h", (2, 2), torch.float16), MatrixItem("f", (2, 2), torch.float32)]
        plan = plan_owners(items, n, replicate_size=replicas)
        values = {"h": 40000.0, "f": 0.1 * (rank + 1)}
        buckets = make_buckets(plan)
        for b in buckets:
            for name in b.names:
                b.view(name).fill_(values[name])
        owned = reduce_to_owners(buckets, plan, group=shard, replicate_group=replicate).wait()
        return {k: v.clone() for k, v in owned.items()}

    world = 2 * replicas
    results = run_on_ranks(body, world, timeout=60)
    got = {k: v for owned in results for k, v in owned.items()}
    assert torch.equal(got["h"], torch.full((2, 2), 40000.0, dtype=torch.float16)), got["h"]
    f = torch.tensor([0.1 * (r + 1) for r in range(world)], dtype=torch.float32)
    assert torch.equal(got["f"], torch.full((2, 2), f.sum().item() / world)), got["f"]


def test_a_rank_owning_nothing_puts_its_buffers_where_it_is_told():
    """A rank that owns no item of the plan (a layer with fewer matrices than ranks) hands
    in no update and no result: its send and receive buffers went to torch's default
    device, the CPU, beside its peers' GPU buffers (NCCL refuses them). With ``device=``
    (what the engines pass: the parameters') or an ``out`` (its device), they are there.
    ``meta`` stands in for the GPU; the collectives are recorded, not run."""
    import sys

    # the module, not the function dmuon.comm re-exports under the same name
    gather_module = sys.modules["dmuon.comm.all_gather_updates"]

    def body(rank, n):
        seen: list[tuple[str, str, str]] = []

        def record(what):
            def collective(out, inp, *args, **kwargs):
                seen.append((what, str(inp.device), str(out.device)))

            return collective

        gather_module.all_gather_single = record("all_gather")  # type: ignore[assignment]
        dist.all_to_all_single = record("all_to_all")  # type: ignore[assignment]
        plan = plan_owners([MatrixItem("w", (4, 4))], n)
        mine = {name: torch.zeros(4, 4, device="meta") for name in plan.names_of(rank)}
        others = {} if mine else {"w": torch.zeros(4, 4, device="meta")}
        all_gather_updates(mine, plan, device="meta")
        all_gather_updates(mine, plan, out=others)  # the replicated engine's out
        shards = {"w": torch.zeros(2, 4, device="meta")}
        shard_all_to_all(shards, plan, device="meta")
        shard_all_to_all_reverse(mine, plan, device="meta")
        return plan.names_of(rank), seen

    results = run_on_ranks(body, 2, timeout=60)
    assert [tuple(names) for names, _ in results] == [("w",), ()]  # rank 1 owns nothing
    for rank, (_, seen) in enumerate(results):
        assert len(seen) == 4, seen
        for what, send, recv in seen:
            assert send == recv == "meta", (rank, what, send, recv)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_shard_all_to_all_rebuilds_full_matrices_and_returns_the_right_shards(world):
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        full = {i.name: data(i.name, 7) for i in ITEMS}  # the same global tensors everywhere
        shards = {name: torch_chunk_shard(t, n, rank) for name, t in full.items()}
        shards["h.0.tall"] = shards["h.0.tall"].mT.contiguous().mT  # any layout works
        gathered = shard_all_to_all(shards, plan).wait()
        assert sorted(gathered) == sorted(plan.names_of(rank))
        for name, t in gathered.items():
            assert torch.equal(t, full[name]), name
        results = {name: t * 2 - rank for name, t in gathered.items()}
        back = shard_all_to_all_reverse(results, plan).wait()
        assert sorted(back) == sorted(plan.names)
        for name, t in back.items():
            expected = torch_chunk_shard(full[name] * 2 - plan.owner(name), n, rank)
            assert t.shape == expected.shape and torch.equal(t, expected), name
        return {name: tuple(s.shape) for name, s in shards.items()}

    shapes = run_on_ranks(body, world, timeout=60)
    if world >= 2:
        assert shapes[-1]["h.1.row"] == (0, 5)  # empty shards took part
    if world == 4:
        assert shapes[3]["h.0.wide"] == (0, 10) and shapes[2]["h.0.tall"] == (3, 2)


def vote_inputs(rank, shape):
    """Entries in {−1, −0.0, 0, +1}: every vote count, ties included, occurs."""
    g = torch.Generator().manual_seed(1234 + rank)
    choice = torch.randint(0, 4, shape, generator=g)
    return torch.tensor([-1.0, -0.0, 0.0, 1.0])[choice]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_majority_vote_packed_equals_int8_equals_the_stacked_vote(world):
    def body(rank, n):
        results = []
        for shape in [(1001,), (37, 13), (5,), (0, 4)]:
            x = vote_inputs(rank, shape)
            packed = majority_vote(x, method="packed")
            int8 = majority_vote(x, method="int8")
            stacked = torch.stack([vote_inputs(r, shape) for r in range(n)])
            plus, minus = (stacked > 0).sum(0), (stacked < 0).sum(0)  # zero abstains
            reference = (plus > minus).float() - (plus < minus).float()  # a tie gives 0
            assert packed.shape == x.shape and packed.dtype == x.dtype
            assert torch.equal(packed, int8) and torch.equal(packed, reference), shape
            # ties among voters, and positions where most ranks abstain but one votes
            results.append(
                (int(((plus == minus) & (plus > 0)).sum()), int((plus + minus == 1).sum()))
            )
        return results

    ties, lone = run_on_ranks(body, world, timeout=60)[0][0]
    if world > 1:
        assert lone > 0  # one rank's vote carried against the abstentions
    if world % 2 == 0:
        assert ties > 0  # exact ties were voted on


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_byte_counts_equal_the_analytical_counts(world):
    def body(rank, n):
        plan = plan_owners(ITEMS, n)
        stats = CommStats()
        buckets = make_buckets(plan)
        reduce_to_owners(buckets, plan, stats=stats).wait()
        broadcast_from_owners(buckets, plan, stats=stats).wait()
        updates = {name: data(name, 0) for name in plan.names_of(rank)}
        all_gather_updates(updates, plan, stats=stats).wait()
        full = {i.name: data(i.name, 0) for i in ITEMS}
        shards = {k: torch_chunk_shard(v, n, rank) for k, v in full.items()}
        owned = shard_all_to_all(shards, plan, stats=stats).wait()
        shard_all_to_all_reverse(owned, plan, stats=stats).wait()
        numel = 3 * 4096 + 5
        majority_vote(torch.randn(numel), method="packed", stats=stats)
        majority_vote(torch.randn(numel), method="int8", stats=stats)
        return stats.as_dict(), list(plan.owners)

    for rank, (got, owners) in enumerate(run_on_ranks(body, world, timeout=60)):
        n = world
        plan = plan_owners(ITEMS, n)
        assert list(plan.owners) == owners
        owner = {name: plan.owner(name) for name in plan.names}
        P = sum(i.nbytes for i in ITEMS)
        bucket_count = len({(owner[i.name], i.dtype) for i in ITEMS})
        collectives = bucket_count if n > 1 else 0
        for op in ("reduce_to_owners", "broadcast_from_owners"):
            assert got[op]["collectives"] == collectives
            assert got[op]["payload_bytes"] == (P if n > 1 else 0)
            assert got[op]["bytes_sent"] == pytest.approx((n - 1) / n * P)
        # all-gather: one per dtype, each rank's chunk padded to the largest volume.
        expected = 0
        for dtype in (torch.float32, torch.bfloat16):
            its = [i for i in ITEMS if i.dtype == dtype]
            volume = max(sum(i.numel for i in its if owner[i.name] == r) for r in range(n))
            expected += (n - 1) * volume * its[0].element_size
        assert got["all_gather_updates"]["bytes_sent"] == pytest.approx(expected)

        def padded(item, n=n):
            return math.ceil(item.shape[0] / n) * math.prod(item.shape[1:]) * item.element_size

        to_others = sum(padded(i) for i in ITEMS if owner[i.name] != rank)
        to_me = (n - 1) * sum(padded(i) for i in ITEMS if owner[i.name] == rank)
        assert got["shard_all_to_all"]["bytes_sent"] == to_others
        assert got["shard_all_to_all"]["bytes_received"] == to_me
        assert got["shard_all_to_all_reverse"]["bytes_sent"] == to_me
        assert got["shard_all_to_all_reverse"]["bytes_received"] == to_others
        numel = 3 * 4096 + 5
        chunk = math.ceil(numel / (VOTES_PER_BYTE * n))  # bytes: five votes per byte
        packed = got["majority_vote[packed]"]["bytes_sent"] if n > 1 else 0.0
        assert packed == pytest.approx(2 * (n - 1) * chunk)
        fp32_all_reduce = cost_model("all_reduce", 4 * numel, n).bytes_sent
        assert packed <= fp32_all_reduce / 19.9
        int8 = got["majority_vote[int8]"]["bytes_sent"] if n > 1 else 0.0
        assert int8 == pytest.approx(2 * (n - 1) / n * numel)
