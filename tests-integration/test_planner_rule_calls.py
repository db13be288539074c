"""The planner's Newton–Schulz calls per rank are the rule calls the engine makes.

Each layer-by-layer mode trains a four-block GPT on 2 gloo ranks (each rank owns two
blocks' matrices, of the same four shapes), and a spy on
:func:`dmuon.optim.batches._run_batch` (one call per batched rule call) counts the calls
of the second step's ``opt.step()`` on each rank. The planner, given the plan the
engine made, must count as many per rank (:func:`~dmuon.optim.planner.rule_calls.rule_calls`
over :func:`~dmuon.optim.planner.traffic.step_units`), and its ``ns_s`` under a profile
whose only cost is one second per call must be the busiest rank's count. Pricing by
:func:`dmuon.comm.plan_owners`' loads (same-shape matrices batched across layers,
the planner's rule before) counts fewer calls wherever a unit is smaller than the
model: ZeRO-3-like owner mode steps block by block, 8 calls per rank where the loads
count 4 (owner mode and the planned modes pack this small model into one unit: 4
either way). The planned modes are counted unpacked too (``layer_pack_mb=0``, the
``_unpacked`` rows): block by block, 8 calls; sign mode, which steps every matrix on
every rank, 16, where one batch per shape across the layers (its price before) counts 4.
"""

import pytest
from distributed_cases import OPT, batch, build, loss_of, setup

from dmuon.comm.testing import run_on_ranks

# the engine's setup → the planner's mode
MODES = {
    "owner_fsdp": "owner",
    "owner_fsdp_z3": "owner-z3",
    "owner_ddp": "owner-ddp",
    "owner_ddp_sharded_adamw": "owner-ddp-zero1",  # the scalars owned: AdamW's, no NS call
    "sharded": "sharded",
    "replicated": "replicated",
    "sign": "sign",
    "sharded_unpacked": "sharded",
    "replicated_unpacked": "replicated",
    "sign_unpacked": "sign",
}


def count_calls(rank, world, mode):
    import torch

    from dmuon.optim import batches

    mode, unpacked, _ = mode.partition("_unpacked")
    kw = dict(OPT, layer_pack_mb=0) if unpacked else dict(OPT)
    if mode == "sign":  # every rank steps every matrix, unit by unit (engine/sign.py)
        from dmuon.optim import DMuon, param_groups

        forward, ded = build("gpt_deep"), None
        opt = DMuon(param_groups(forward), mode="sign", rule="sign_muon", **kw)
    else:
        _, forward, opt, ded = setup(mode, "gpt_deep", world, kw)
    run_batch = batches._run_batch
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return run_batch(*args, **kwargs)

    counted = 0
    for t in range(2):
        loss_of("gpt", forward, *batch("gpt", t, rank, world)).backward()
        calls.clear()
        batches._run_batch = spy
        try:
            opt.step()
        finally:
            batches._run_batch = run_batch
        counted = len(calls)
        opt.zero_grad()
        if ded is not None:
            ded.wait()
    plan = ded.plan if ded is not None else opt._engine.plan
    torch.distributed.barrier()
    return counted, plan


@pytest.mark.parametrize("mode", sorted(MODES))
def test_planner_counts_the_engines_rule_calls_per_rank(mode):
    from dmuon.optim.planner.config import spec_from_module
    from dmuon.optim.planner.profiles import ClusterProfile, DeviceProfile, Link
    from dmuon.optim.planner.rule_calls import rule_calls
    from dmuon.optim.planner.step_model import TrainingShape, predict
    from dmuon.optim.planner.traffic import step_units

    world = 2
    out = run_on_ranks(count_calls, world, args=(mode,), timeout=240)
    kind = MODES[mode]
    spec = spec_from_module(build("gpt_deep"), "gpt")
    plan = out[0][1]
    counts = [c for c, _ in out]
    assert min(counts) > 0, counts
    units = step_units(spec, plan, kind, layer_pack_mb=0 if "_unpacked" in mode else 1.0)
    # the CPU engine batches at most 2**20 matrix entries per rule call
    # sign mode: every rank steps every matrix (its plan's items, whatever their owner)
    items = [plan.items] * world if kind == "sign" else [plan.items_of(r) for r in range(world)]
    if kind == "owner-ddp-zero1":  # the plan's scalars are stepped by AdamW, not the rule
        scalars = {n for n, _ in spec.scalars}
        items = [[i for i in its if i.name not in scalars] for its in items]
    mine = [len(rule_calls(items[r], units, batch_limit=1 << 20)) for r in range(world)]
    assert mine == counts, (mode, mine, counts)
    # the step model prices those calls: one second each, nothing else (a CPU profile)
    device = DeviceProfile(
        "calls", peak_flops=1e300, memory_bytes=1e12, memory_bandwidth=1e300,
        call_overhead=1.0, measured={"machine": {"gpu": None}},
    )  # fmt: skip
    link = Link("free", 1e12, alpha=0.0, efficiency=1.0, source="")
    p = predict(spec, ClusterProfile(device, world, world, link, link),
                TrainingShape(global_tokens=1024), modes=(kind,), plan=plan)  # fmt: skip
    if "_unpacked" not in mode:  # the step model prices DMuon's default packing
        assert p.modes[kind].ns_s == pytest.approx(max(counts), abs=1e-6), (mode, counts)
