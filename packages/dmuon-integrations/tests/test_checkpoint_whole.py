"""``whole_tensor`` / ``shard_of``: DTensors made whole and cut back for checkpoints.

The reference is DTensor's own ``full_tensor()`` and ``distribute_tensor`` (a scatter
from rank 0) of the same tensors on the same gloo ranks: bitwise equal, over one and
two mesh dimensions (FSDP2 over tensor parallelism's ``_StridedShard`` included),
uneven and empty shards included. A rank that does not join is
``test_checkpoint_deadline.py``'s (tests-integration).
"""

from __future__ import annotations

import torch

from dmuon.comm.testing import run_on_ranks


def _cases():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # (mesh shape, global shape, placements)
    return [
        ((2,), (5, 7), [Shard(0)]),  # rows 3 + 2
        ((2,), (5, 7), [Shard(1)]),  # columns 4 + 3
        ((2,), (5,), [Replicate()]),
        ((4,), (3, 6), [Shard(0)]),  # rows 1 + 1 + 1 + 0: an empty shard
        ((4,), (2, 3, 5), [Shard(2)]),  # a stack, split along its last dimension
        ((2, 2), (6, 5), [Shard(0), Shard(1)]),
        ((2, 2), (5, 3), [Shard(1), Shard(0)]),
        ((2, 2), (6, 5), [Replicate(), Shard(1)]),
        # FSDP2 over tensor parallelism: tp's blocks cut again over dp
        ((2, 2), (8, 3), [_StridedShard(0, split_factor=2), Shard(0)]),
        ((2, 2), (7, 5), [_StridedShard(0, split_factor=2), Shard(0)]),  # tp 4 + 3, dp 2+2, 2+1
        ((2, 2), (3, 4), [_StridedShard(0, split_factor=2), Shard(0)]),  # empty blocks
        ((2, 2), (4, 5), [_StridedShard(1, split_factor=2), Shard(1)]),
    ]


def run_cases(rank: int, world: int) -> list[tuple[int, bool, bool, bool]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from dmuon.integrations.checkpoint.whole import gathers_itself, shard_of, whole_tensor

    out = []
    for k, (mesh_shape, shape, placements) in enumerate(_cases()):
        if torch.Size(mesh_shape).numel() != world:
            continue
        names = ("dp", "tp")[-len(mesh_shape) :]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        full = torch.randn(shape, generator=torch.Generator().manual_seed(k))
        full[0].fill_(-0.0)  # negative zeros survive a copy, not a sum
        # scattered from rank 0; torch's scatter refuses an uneven _StridedShard, whose
        # blocks every rank cuts from the same full tensor instead (the same values)
        strided = any(hasattr(pl, "split_factor") for pl in placements)
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None if strided else 0)
        got = whole_tensor(dt, f"case {k}")
        want = dt.full_tensor()
        same_whole = got.shape == want.shape and torch.equal(
            got.reshape(-1).view(torch.int32), want.reshape(-1).view(torch.int32)
        )
        cut = shard_of(full, dt)
        same_cut = (
            cut.placements == dt.placements
            and cut.shape == dt.shape
            and torch.equal(
                cut.to_local().reshape(-1).view(torch.int32),
                dt.to_local().reshape(-1).view(torch.int32),
            )
        )
        out.append((k, gathers_itself(dt), same_whole, same_cut))
    return out


def test_whole_tensor_and_shard_of_equal_dtensors_own_bitwise():
    for world in (2, 4):
        for rank, results in enumerate(run_on_ranks(run_cases, world, timeout=120)):
            assert results, f"no case ran on {world} ranks"
            for k, own, same_whole, same_cut in results:
                assert own, f"case {k}: whole_tensor fell back to full_tensor()"
                assert same_whole, f"case {k}, rank {rank}: whole_tensor != full_tensor()"
                assert same_cut, f"case {k}, rank {rank}: shard_of != distribute_tensor"


def run_fallback(rank: int, world: int) -> tuple[bool, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    from dmuon.integrations.checkpoint.whole import gathers_itself, whole_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    dt = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Partial()])
    return gathers_itself(dt), torch.equal(whole_tensor(dt), dt.full_tensor())


def test_a_layout_it_does_not_gather_is_left_to_full_tensor():
    """A pending sum is not a gather: ``full_tensor()`` carries it out, as before."""
    for own, same in run_on_ranks(run_fallback, 2, timeout=60):
        assert not own and same


def run_full(rank: int, world: int, layout: str) -> dict[str, bool] | None:
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations.checkpoint import full_state_dict
    from dmuon.integrations.checkpoint.whole import gathers_itself
    from dmuon.optim import DMuon, param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))  # 5: uneven over 2
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if layout == "fsdp_tp":  # FSDP2 over dp 2 of tensor parallelism over tp 2
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        mode = "sharded"
    elif layout == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mode = "single"
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
        mode = "sharded"
    opt = DMuon(param_groups(model), mode=mode, lr=0.02)
    if layout == "fsdp_tp":  # _StridedShard rows: gathered by DMuon, not full_tensor()
        assert gathers_itself(model[0].weight), model[0].weight.placements
    want = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    got = full_state_dict(model, opt)
    if rank != 0:
        return None
    return {
        k: got["model"][k].dtype == v.dtype
        and torch.equal(got["model"][k].view(torch.int32), v.view(torch.int32))
        for k, v in want.items()
    } | {"same keys": sorted(got["model"]) == sorted(want)}


def test_full_state_dict_gathers_the_model_as_dsds_full_state_dict_bitwise():
    """The one-file save gathers the weights with DMuon's all-gathers (under the
    checkpoint's deadline) where it called torch's ``get_model_state_dict(...,
    full_state_dict=True)``: the same keys and bits, for tensor-parallel shards (uneven
    rows and columns), FSDP2's rows, and FSDP2 over tensor parallelism (4 ranks)."""
    for layout, world in (("tp", 2), ("fsdp", 2), ("fsdp_tp", 4)):
        same = run_on_ranks(run_full, world, args=(layout,), timeout=120)[0]
        assert same and all(same.values()), (layout, same)


def run_scattered(rank: int, world: int) -> list[tuple[str, bool]]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dmuon.integrations.checkpoint.sharded_state import scattered

    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")
    out = []
    shapes = [(5, 7), (1, 4), (world + 1, 3), (4, 2, 3), (7,)]  # uneven, empty shards, 3-D, 1-D
    for k, shape in enumerate(shapes):
        for dtype in (torch.float32, torch.bfloat16):
            for owner in (0, world - 1):
                full = torch.randn(shape, generator=torch.Generator().manual_seed(k)).to(dtype)
                full.view(-1)[0] = -0.0  # a negative zero survives a copy, not a sum
                mine = full if rank == owner else torch.full(shape, float("nan"), dtype=dtype)
                want = distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=owner)
                got = scattered(mine, mesh, owner, f"case {k}")
                a, b = got.to_local(), want.to_local()
                same = (
                    got.placements == want.placements
                    and got.shape == want.shape
                    and got.stride() == want.stride()
                    and a.shape == b.shape
                    and a.dtype == b.dtype
                    and torch.equal(
                        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                    )
                )
                out.append((f"{shape} {dtype} from rank {owner}", same))
    return out


def test_scattered_equals_distribute_tensor_from_the_owner_bitwise():
    """The owner-rooted scatter of a checkpoint's owner-held state (``sharded_state``)
    gives ``distribute_tensor(full, mesh, [Shard(0)], src_data_rank=owner)``'s DTensor
    bit for bit — same shape, stride and local blocks, uneven and empty row blocks, bf16,
    owners first and last — with the other ranks' ``full`` NaN (only the owner's is read).
    Its wait under the deadline is ``test_checkpoint_deadline.py``'s."""
    for world in (2, 3):
        for rank, results in enumerate(run_on_ranks(run_scattered, world, timeout=120)):
            bad = [case for case, same in results if not same]
            assert results and not bad, f"{world} ranks, rank {rank}: {bad}"
