"""HSDP on 4 ranks as 2 × 2 (replicate × shard) equals one process.

Owner mode: the reduction has two stages (within the shard group to the owner's
shard index, then across the replicate group to the owner) and the owner's new
weights go back across replicas, then within shard groups, waited in the next
forward. Sharded mode under FSDP2's HSDP (``Replicate``, ``Shard(0)`` DTensors):
each replica runs the all-to-all within its shard group. Each mode's
``full_state_dict``, taken before step 3, resumes in one process.
"""

from distributed_cases import (
    OPT,
    STEPS,
    TOLERANCE,
    batch,
    build,
    full_params,
    loss_of,
    max_diff,
    reference,
)

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

NAME = "gpt"
RESUME_AT = STEPS - 2  # both modes save their state (full_state_dict) before this step


def run_hsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.comm import CommStats
    from dmuon.integrations import checkpoint, fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out, stages, resumable = {}, None, {}
    for mode in ("owner", "sharded"):
        model = build(NAME)
        kw = dict(OPT)
        ignored = None
        if mode == "owner":
            stats = CommStats()
            ded = fsdp.dedicate(model, mesh, stats=stats)
            assert ded.plan.replicate_size == 2 and ded.replicate_group is not None
            kw["distributed"] = ded
            ignored = ded.params
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
        opt = DMuon(param_groups(model), **kw)
        assert opt.mode == mode
        for t in range(STEPS):
            if t == RESUME_AT:  # the state, whole on rank 0 (owner mode: from each owner)
                resumable[mode] = checkpoint.full_state_dict(model, opt)
            loss_of(NAME, model, *batch(NAME, t, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        if mode == "owner":
            ded.wait()
            stages = stats.as_dict()
        out[mode] = full_params(model)
    return out, stages, resumable if rank == 0 else None


def resume_in_one_process(sd) -> dict:
    """The rest of the run in one process from an HSDP run's full state dict (4 ranks →
    1: the checkpoint reshards), on the global batches the 4 ranks had."""
    from dmuon.integrations import checkpoint

    model = build(NAME)
    opt = DMuon(param_groups(model), **OPT)
    checkpoint.load_full_state_dict(model, opt, sd)
    for t in range(RESUME_AT, STEPS):
        losses = [loss_of(NAME, model, *batch(NAME, t, r, 4)) for r in range(4)]
        (sum(losses) / 4).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def test_hsdp_2x2_equals_one_process():
    expected = reference(NAME, 4)
    results = run_on_ranks(run_hsdp, 4, timeout=180)
    # each mode's checkpoint, taken at step RESUME_AT, resumes in one process (owner
    # mode's was refused before: each owner a slot of the 2-D mesh)
    for mode, sd in results[0][2].items():
        diff, where = max_diff(resume_in_one_process(sd), expected)
        assert diff <= TOLERANCE, f"HSDP {mode} resumed in one process: {where} off by {diff:.2e}"
    for rank, (params, stages, _) in enumerate(results):
        for mode, got in params.items():
            diff, where = max_diff(got, expected)
            assert diff <= TOLERANCE, f"HSDP {mode}, rank {rank}: {where} differs by {diff:.2e}"
        # two stages: per bucket one reduce within the shard group, and on the ranks
        # of the owner's shard index one more across the replicate group
        assert stages["reduce_to_owners"]["collectives"] > 0
        assert stages["broadcast_from_owners"]["collectives"] > 0


def run_one_replica(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model = build(NAME)
    ded = fsdp.dedicate(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    for t in range(STEPS):
        loss_of(NAME, model, *batch(NAME, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    return full_params(model), ded.replicate_group is None


def test_hsdp_mesh_of_one_replica_trains_as_fsdp2():
    """A ``(1, N)`` HSDP mesh (one replica: a launcher's default of ``dp_replicate=1``)
    is FSDP2 over the shard group: owner mode plans over it and trains like one process.
    The plan had one replica while the replicate group was passed on, and the first
    backward raised in ``reduce_to_owners``."""
    expected = reference(NAME, 2)
    for rank, (got, flat) in enumerate(run_on_ranks(run_one_replica, 2, timeout=120)):
        assert flat, rank
        diff, where = max_diff(got, expected)
        assert diff <= TOLERANCE, f"rank {rank}: {where} differs by {diff:.2e}"
