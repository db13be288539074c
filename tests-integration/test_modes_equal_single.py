"""Every distributed mode reaches the parameters of one process on the same global batch.

For a small GPT (benchmarks/common) and a model with a conv stem and 3-D expert
stacks, on 1, 2, 3 and 4 ranks: owner mode under FSDP2 (matrices dedicated,
``fully_shard`` for the rest), owner mode as a DDP replacement (scalars all-reduced,
and scalars owned: sharded AdamW), replicated mode under stock DDP and sharded mode
under stock FSDP2 each train 5 steps; the reference trains the same model in this
process on the mean of the ranks' losses. One launch per world size runs every mode.

Tolerance 1e-5 (fp32 Newton–Schulz): the runs differ only in the order of the
gradient sums. AdamW's ε is 1e-3 here: with a tiny ε, AdamW turns a gradient
element that cancels to ~0 into ±1·lr whose sign is decided by rounding, which
would test AdamW's conditioning rather than the engine.
"""

import pytest
from distributed_cases import STEPS, TOLERANCE, build, full_params, max_diff, reference, run_modes

from dmuon.comm.testing import run_on_ranks

MODES = {
    "gpt": ["owner_fsdp", "owner_ddp", "owner_ddp_sharded_adamw", "replicated", "sharded"],
    "mixed": ["owner_fsdp", "owner_ddp", "replicated", "sharded"],
}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["gpt", "mixed"])
def test_every_mode_reaches_the_single_process_parameters(name, world):
    expected = reference(name, world)
    moved, _ = max_diff(expected, full_params(build(name)))
    assert moved > 1e-2, "the reference barely trained: the comparison would prove nothing"
    results = run_on_ranks(run_modes, world, args=(name, MODES[name], STEPS), timeout=180)
    for mode in MODES[name]:
        for rank in range(world):
            diff, where = max_diff(results[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"
            # every rank ends with the same weights (owners' broadcasts, all-gathers)
            same, where = max_diff(results[rank][mode], results[0][mode])
            assert same == 0.0, f"{mode}: rank {rank} and rank 0 differ at {where}"
