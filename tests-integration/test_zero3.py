"""ZeRO-3-like owner mode (``reshard_after_forward=True``) trains like one process, keeps
only owned matrices between layers, and moves 3(N−1)/N·P bytes per step (broadcast for
forward, re-broadcast for backward, reduce)."""

import pytest
from distributed_cases import (
    STEPS,
    TOLERANCE,
    batch,
    build,
    loss_of,
    max_diff,
    reference,
    run_modes,
)

from dmuon.comm.testing import run_on_ranks

NAME = "gpt"


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_like_owner_mode_equals_one_process(world):
    expected = reference(NAME, world)
    modes = ["owner_fsdp_z3", "owner_ddp_z3"]
    results = run_on_ranks(run_modes, world, args=(NAME, modes, STEPS), timeout=180)
    for rank in range(world):
        for mode in modes:
            diff, where = max_diff(results[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"


def run_memory_and_bytes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.comm import CommStats
    from dmuon.integrations import fsdp
    from dmuon.optim import DMuon, param_groups

    model = build(NAME)
    stats = CommStats()
    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(model, mesh, reshard_after_forward=True, stats=stats)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), distributed=ded, ns_compute_dtype="float32")
    params = dict(model.named_parameters())
    held = []
    for t in range(2):
        stats.reset()
        loss_of(NAME, model, *batch(NAME, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        held.append({n: params[n].untyped_storage().nbytes() > 0 for n in ded.names})
        ops = stats.ops
        sent = ops["reduce_to_owners"].bytes_sent + ops["broadcast_from_owners"].bytes_sent
    P = sum(i.nbytes for i in ded.plan.items)
    return held, sorted(ded.owned), sent, P


def test_zero3_like_frees_what_a_rank_does_not_own_and_moves_three_halves_of_a_ring():
    world = 2
    for held, owned, sent, P in run_on_ranks(run_memory_and_bytes, world, timeout=120):
        for step in held:
            assert sorted(n for n, kept in step.items() if kept) == owned
        assert sent == pytest.approx(3 * (world - 1) / world * P, rel=0.01)
