"""Cautious weight decay in every distributed mode equals one process.

``cautious_weight_decay=True`` decays an entry only where the update agrees with the
weight in sign (``dmuon.optim.apply_update``): a mask of the weight and the update
where both live, so the owner (owner, ``replicated``), the shard's rank (``sharded``)
and a tensor-parallel shard each apply it to what they hold. A GPT trains 5 steps on
3 ranks with a large decay (0.5, so the mask moves the weights visibly; AdamW's
scalars 0.1, cautiously too); every mode
must reach the single-process parameters, and those must differ from plain decay's,
so the comparison is about the mask.

The mask is discontinuous: an entry whose update is within fp32 rounding of zero can be
decayed in one run and not in the other (the runs sum the gradients in different
orders). So: every entry within 1e-5, but at most ``FLIPS`` of the 41 120, and each of
those by no more than its decay over the run (``STEPS·lr·wd·|w|``): measured, one or
two entries per mode, by 5.9e-5 (the decay of a weight of 5.9e-3).
"""

from distributed_cases import OPT, STEPS, TOLERANCE, max_diff, reference, run_modes

from dmuon.comm.testing import run_on_ranks

NAME, WORLD = "gpt", 3
CAUTIOUS = dict(OPT, weight_decay=0.5, adamw_weight_decay=0.1, cautious_weight_decay=True)
MODES = ["owner_fsdp", "owner_ddp", "replicated", "sharded"]
FLIPS = 8


def test_cautious_weight_decay_in_every_mode_equals_one_process():
    expected = reference(NAME, WORLD, opt_kw=CAUTIOUS)
    plain = reference(NAME, WORLD, opt_kw=dict(CAUTIOUS, cautious_weight_decay=False))
    apart, _ = max_diff(expected, plain)
    assert apart > 1e-3, f"cautious and plain decay differ by {apart:.1e} only"
    results = run_on_ranks(run_modes, WORLD, args=(NAME, MODES, STEPS, CAUTIOUS), timeout=180)
    decay = CAUTIOUS["lr"] * CAUTIOUS["weight_decay"]
    for mode in MODES:
        for rank in range(WORLD):
            got, flips = results[rank][mode], 0
            for name, want in expected.items():
                diff = (got[name] - want).abs()
                apart = diff > TOLERANCE
                flips += int(apart.sum())
                bound = 1.1 * STEPS * decay * want.abs() + TOLERANCE  # a flipped mask entry
                worst = float((diff - bound).max())
                assert worst <= 0, f"{mode}, rank {rank}: {name} beyond one decay by {worst:.1e}"
            assert flips <= FLIPS, f"{mode}, rank {rank}: {flips} entries differ"
            same, where = max_diff(got, results[0][mode])  # the ranks agree exactly
            assert same == 0.0, f"{mode}: rank {rank} and rank 0 differ at {where}"
