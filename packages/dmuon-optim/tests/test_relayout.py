"""``relaid``: a DTensor gradient laid out anew by DMuon's own collectives, under its deadline.

The reference is DTensor's ``redistribute`` of the same tensor on the same gloo ranks:
the results must be bitwise equal (the same collectives on the same local tensors, in
the same order of mesh dimensions), for every change of layout the engines make —
pending sums made replicated or sharded (uneven and empty shards included), a
replicated gradient cut to its shard, over one and over two mesh dimensions. The
gradient handed in is left as it was (it may still be read as a pending sum). A change
the engines never make is refused by name; a rank that does not come is
``test_tensor_parallel_deadline.py``'s (tests-integration).
"""

from __future__ import annotations

import pytest
import torch

from dmuon.comm.testing import run_on_ranks


def _cases():
    from torch.distributed.tensor import Partial, Replicate, Shard

    # (mesh shape, global shape, gradient placements, parameter placements)
    return [
        ((2,), (5, 7), [Partial()], [Replicate()]),
        ((2,), (5, 7), [Partial()], [Shard(0)]),  # rows 3 + 2
        ((2,), (5, 7), [Partial()], [Shard(1)]),  # columns 4 + 3
        ((4,), (3, 6), [Partial()], [Shard(0)]),  # rows 1 + 1 + 1 + 0: an empty shard
        ((4,), (6, 5), [Replicate()], [Shard(1)]),  # columns 2 + 2 + 1 + 0
        ((4,), (6,), [Partial("avg")], [Replicate()]),
        ((2, 2), (6, 5), [Partial(), Partial()], [Replicate(), Replicate()]),
        ((2, 2), (6, 5), [Shard(0), Partial()], [Shard(0), Shard(1)]),
        ((2, 2), (6, 5), [Replicate(), Partial()], [Replicate(), Shard(0)]),
    ]


def run_cases(rank: int, world: int) -> list[tuple[str, bool, bool, bool]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dmuon.optim.engine.relayout import relaid

    out = []
    for k, (mesh_shape, shape, have, want) in enumerate(_cases()):
        if torch.Size(mesh_shape).numel() != world:
            continue
        names = ("dp", "tp")[-len(mesh_shape) :]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        # the local part: the global shape cut by the gradient's shards; each rank its own
        # values (the reference reads the same local parts, whatever they mean)
        part = torch.zeros(shape)
        for d, pl in enumerate(have):
            if pl.is_shard():
                part = part.chunk(mesh_shape[d], dim=pl.dim)[mesh.get_local_rank(d)]
        g = torch.Generator().manual_seed(10 * k + rank)
        local = torch.randn(part.shape, generator=g)
        dt = DTensor.from_local(
            local, mesh, have, run_check=False, shape=shape, stride=torch.zeros(shape).stride()
        )
        before = dt.to_local().clone()
        want_dt = dt.redistribute(mesh, want)
        got = relaid(dt, want, name="w")
        same = torch.equal(got.to_local(), want_dt.to_local())
        laid = tuple(got.placements) == tuple(want) and got.shape == want_dt.shape
        kept = torch.equal(dt.to_local(), before)
        out.append((f"{mesh_shape} {shape} {have} -> {want}", same, laid, kept))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_relaid_equals_dtensor_redistribute_bitwise(world):
    results = run_on_ranks(run_cases, world, timeout=120)
    for rank, cases in enumerate(results):
        assert cases, f"rank {rank}: no case ran"
        for what, same, laid, kept in cases:
            assert same, f"rank {rank}: {what}: values differ from DTensor's redistribute"
            assert laid, f"rank {rank}: {what}: placements or shape differ"
            assert kept, f"rank {rank}: {what}: the gradient handed in was changed"


def run_refused(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dmuon.optim.engine.relayout import relaid

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    dt = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False)
    try:
        relaid(dt, [Replicate()], name="fc.weight")
    except NotImplementedError as err:
        return str(err)
    return ""


def test_a_change_the_engines_never_make_is_refused_by_name():
    for msg in run_on_ranks(run_refused, 2, timeout=60):
        assert "'fc.weight'" in msg and "(Shard(dim=0),)" in msg and "'tp'" in msg, msg
