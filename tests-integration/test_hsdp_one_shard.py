"""Owner mode on an HSDP mesh of shard size 1, ``(R, 1)``, equals one process.

Every rank is a whole replica: FSDP2 keeps the scalar parameters it manages as
``(Replicate(), Shard(0))`` DTensors whose shard group is the rank alone, and averages
their gradients over the replicate dimension. Owner mode took them for parameters that
nothing synchronises (it looked for ranks of the dedication's shard group only, which
is this rank) and refused the model with "Pass it to fully_shard" although they were.
Now it counts every rank of the dedication (shard group and replicate group), and the
run, clipped by the total gradient norm, trains as one process, every rank alike to
the bit.
"""

import torch
from distributed_cases import OPT, STEPS, TOLERANCE, batch, build, full_params, loss_of, max_diff

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, clip_grad_norm_, param_groups

NAME = "gpt"
MAX_NORM = 0.5  # below the tiny GPT's gradient norms: the clipping scales every step


def run_one_shard(rank, world, clip):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = build(NAME)
    ded = fsdp.dedicate(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    scalars = [n for n, p in model.named_parameters() if hasattr(p, "placements")]
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    norms = []
    for t in range(STEPS):
        loss_of(NAME, model, *batch(NAME, t, rank, world)).backward()
        if clip:
            norms.append(float(clip_grad_norm_(opt, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    ded.wait()
    return full_params(model), norms, scalars


def reference_run(world, clip):
    """One process, the mean over the ranks' rows of each global batch."""
    model = build(NAME)
    opt = DMuon(param_groups(model), **OPT)
    norms = []
    for t in range(STEPS):
        losses = [loss_of(NAME, model, *batch(NAME, t, r, world)) for r in range(world)]
        (sum(losses) / world).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return full_params(model), norms


def check(clip):
    expected, expected_norms = reference_run(2, clip)
    results = run_on_ranks(run_one_shard, 2, args=(clip,), timeout=120)
    assert results[0][2], "FSDP2 left no scalar parameter as a DTensor: nothing tested"
    for rank, (got, norms, _) in enumerate(results):
        diff, where = max_diff(got, expected)
        assert diff <= TOLERANCE, f"(2, 1) HSDP, rank {rank}: {where} differs by {diff:.2e}"
        for t, (n, e) in enumerate(zip(norms, expected_norms, strict=True)):
            assert abs(n - e) <= 1e-5 * e, f"rank {rank}, step {t}: norm {n} != {e}"
        diff, where = max_diff(got, results[0][0])
        assert diff == 0, f"rank {rank} differs from rank 0 at {where} by {diff:.2e}"


def test_hsdp_mesh_of_shard_size_one_trains_as_one_process():
    check(clip=False)


def test_hsdp_mesh_of_shard_size_one_clips_as_one_process():
    """``clip_grad_norm_`` counts each FSDP2 scalar once (on the first replica) and sums
    the norms over the replicate group: the same total norm as one process."""
    check(clip=True)
