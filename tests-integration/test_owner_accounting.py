"""Owner mode does what the plan says: each matrix orthogonalised exactly once per step
across all ranks, per-rank Newton–Schulz FLOPs equal to the plan's, and the traffic of
one ring all-reduce of the matrices, 2(N−1)/N·P bytes per rank.

Newton–Schulz calls are counted by wrapping the ``orthogonalize`` the rules call
(the batch shape of every call), independently of the engine's own report.
"""

import pytest
from distributed_cases import batch, build, loss_of

from dmuon.comm.testing import run_on_ranks

STEPS = 2


def run_accounting(rank, world, name):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon.optim.transforms.base as chain_base
    from dmuon.comm import CommStats
    from dmuon.integrations import fsdp
    from dmuon.kernels import ns_flops
    from dmuon.optim import DMuon, param_groups

    calls = []
    real = chain_base.orthogonalize

    def counting(G, **kw):
        calls.append((tuple(G.shape), kw["method"], kw["steps"]))
        return real(G, **kw)

    chain_base.orthogonalize = counting
    stats = CommStats()
    model = build(name)
    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(model, mesh, stats=stats)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), ns_compute_dtype="float32", ns_method="gram", ns_steps=5)
    steps = []
    for t in range(STEPS):
        calls.clear()
        stats.reset()
        loss_of(name, model, *batch(name, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        ded.wait()
        ops = stats.ops
        steps.append(
            {
                "matrices": sum(shape[0] for shape, _, _ in calls),
                "flops": sum(
                    ns_flops(shape[1], shape[2], method=m, steps=s, batch=shape[0])
                    for shape, m, s in calls
                ),
                "stepped": sorted(opt.last_step.stepped),
                "report_matrices": opt.last_step.matrices,
                "reduce": ops["reduce_to_owners"].bytes_sent,
                "broadcast": ops["broadcast_from_owners"].bytes_sent,
                "reduce_received": ops["reduce_to_owners"].bytes_received,
                "broadcast_received": ops["broadcast_from_owners"].bytes_received,
            }
        )
    plan = ded.plan
    dist.barrier()
    chain_base.orthogonalize = real
    return {
        "steps": steps,
        "owned": sorted(ded.owned),
        "names": sorted(ded.names),
        "plan_flops": sum(
            ns_flops(i.rows, i.cols, method="gram", steps=5, batch=i.batch)
            for i in plan.items_of(rank)
        ),
        "matrices": sum(i.batch for i in plan.items),
        "P": sum(i.nbytes for i in plan.items),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["gpt", "mixed"])
def test_each_matrix_orthogonalised_once_with_the_planned_flops_and_ring_traffic(name, world):
    out = run_on_ranks(run_accounting, world, args=(name,), timeout=120)
    names, total, P = out[0]["names"], out[0]["matrices"], out[0]["P"]
    assert sorted(n for o in out for n in o["owned"]) == names  # a partition of the matrices
    for t in range(STEPS):
        # exactly once across all ranks: the counted batches add up to every matrix
        assert sum(o["steps"][t]["matrices"] for o in out) == total
        for rank, o in enumerate(out):
            step = o["steps"][t]
            assert step["stepped"] == o["owned"], f"rank {rank} stepped what it does not own"
            assert step["report_matrices"] == step["matrices"]
            assert step["flops"] == o["plan_flops"], f"rank {rank}: NS FLOPs differ from the plan"
            # owner mode = reduce + broadcast of every matrix = one ring all-reduce
            ring = 2 * (world - 1) / world * P
            sent = step["reduce"] + step["broadcast"]
            received = step["reduce_received"] + step["broadcast_received"]
            assert sent == pytest.approx(ring, rel=0.01)
            assert received == pytest.approx(ring, rel=0.01)
