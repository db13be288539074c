"""The planner's bytes per rank equal what DMuon's CommStats records on real gloo ranks.

For each mode the same model is trained on 2, 3 and 4 processes; the second step's
recorded bytes (steady state: the first step's publications are done) are compared,
op by op and rank by rank, with :func:`dmuon.optim.planner.traffic.dmuon_transfers`
for the plan the engine made. The planner never runs a collective: it recounts the
buffers from the plan, so agreement checks the byte formulas against the wrappers.
"""

import pytest
from distributed_cases import OPT, batch, build, loss_of, setup

from dmuon.comm.testing import run_on_ranks

MODES = [
    "owner_fsdp",
    "owner_fsdp_z3",
    "owner_ddp",
    "owner_ddp_sharded_adamw",
    "replicated",
    "sharded",
    "sign",
]
# the setup (distributed_cases.setup) → the planner's mode
KIND = {
    "owner_fsdp": "owner",
    "owner_fsdp_z3": "owner-z3",
    "owner_ddp": "owner-ddp",
    "owner_ddp_sharded_adamw": "owner-ddp-zero1",  # ddp.dedicate(scalars="owner")
}


def measure(rank, world, mode):
    import torch

    from dmuon.comm import default_stats
    from dmuon.optim import DMuon, param_groups

    if mode == "sign":
        model = build("gpt")
        forward, ded = model, None
        opt = DMuon(param_groups(model), mode="sign", rule="sign_muon", **OPT)
    else:
        model, forward, opt, ded = setup(mode, "gpt", world)
    recorded = {}
    for t in range(2):
        default_stats().reset()
        loss_of("gpt", forward, *batch("gpt", t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if ded is not None:
            ded.wait()
        recorded = {k: (v.bytes_sent, v.bytes_received) for k, v in default_stats().ops.items()}
        counts = {k: v.collectives for k, v in default_stats().ops.items()}
    if mode.startswith("owner"):
        plan = ded.plan
    else:
        plan = opt._engine.plan
    torch.distributed.barrier()
    return recorded, plan, counts


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_planner_bytes_equal_commstats_on_gloo_ranks(mode, world):
    from dmuon.comm import plan_owners
    from dmuon.optim.planner.config import spec_from_module
    from dmuon.optim.planner.traffic import dmuon_transfers, owned_scalar_items, per_rank_ops

    out = run_on_ranks(measure, world, args=(mode,), timeout=240)
    spec = spec_from_module(build("gpt"), "gpt")
    engine_plan = out[0][1]
    kind = KIND.get(mode, mode)
    # the planner plans as the engine does (same items, same default options); with
    # scalars="owner" the scalars are planned too, whole, each as one row
    scalars = owned_scalar_items(spec) if kind == "owner-ddp-zero1" else []
    plan = plan_owners([*spec.matrices, *scalars], world)
    if scalars:  # the items ddp.dedicate(scalars="owner") plans: names, shapes, layers
        from dmuon.integrations.selection import split_parameters

        dedicated, _ = split_parameters(build("gpt"), dedicate_rest=True)
        assert sorted((i.name, i.shape, i.layer) for i, _ in dedicated) == sorted(
            (i.name, i.shape, i.layer) for i in plan.items
        )
    assert plan.owners == engine_plan.owners and plan.names == engine_plan.names
    # the CPU engine batches at most 2**20 matrix entries per rule call
    predicted = dmuon_transfers(spec, plan, kind, batch_limit=1 << 20)
    for rank, (recorded, _, counts) in enumerate(out):
        mine = per_rank_ops(predicted, rank)
        moved = {k: v for k, v in recorded.items() if v != (0.0, 0.0)}
        assert sorted(moved) == sorted(k for k, v in mine.items() if v != (0.0, 0.0)), (
            rank,
            moved,
            mine,
        )
        for op, (sent, received) in moved.items():
            assert mine[op] == (pytest.approx(sent), pytest.approx(received)), (rank, op)
        # and as many collectives: one per owner and dtype of each unit (every mode packs
        # the small layers of this GPT into one unit, ZeRO-3-like does not), and
        # ddp.dedicate's one all-reduce of the scalars per unit and dtype (with
        # scalars="owner": the scalars in the unit's buckets per owner, no all-reduce);
        # the planned modes' all-gather, all-to-alls and votes per unit
        unit_ops = (
            "reduce_to_owners",
            "broadcast_from_owners",
            "all_reduce_replicated",
            "all_gather_updates",
            "shard_all_to_all",
            "shard_all_to_all_reverse",
            "majority_vote[packed]",
        )
        for t in predicted:
            if t.op in unit_ops:
                issued = sum(x.collectives for x in predicted if x.op == t.op)
                assert counts[t.op] == issued, (rank, t.op, counts[t.op], issued)
