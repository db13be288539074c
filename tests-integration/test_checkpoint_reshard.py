"""A DCP checkpoint written at 4 ranks resumes at 2 ranks and in one process; one
written at 2 ranks resumes at 4 (every mode, replicated included).

The same small GPT (tests-integration/distributed_cases.py) trains 5 steps at 4
ranks, in owner mode under FSDP2 (matrices dedicated, ``fully_shard`` for the
rest), as a DDP replacement (owner mode, scalars all-reduced) and in sharded mode
(stock FSDP2, DTensor state); each run saves a DCP checkpoint after step 2 and goes
on, so its final parameters are the uninterrupted run. The checkpoint is then
loaded at 2 ranks (same mode, a new owner plan) and into a plain one-process
DMuon (mode ``single``), and 3 more steps are trained on the same global batches.

Tolerance 1e-5 (fp32 Newton–Schulz), as in test_modes_equal_single.py: across
world sizes the runs differ only in the order of the gradient sums (each rank
averages a different share of the global batch), ~1e-7 relative per step. A run
that restores the weights but not the optimizer state misses by far more (checked).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from distributed_cases import OPT, TOLERANCE, full_params, max_diff, setup, train_range

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import checkpoint
from dmuon.optim import DMuon, param_groups

NAME = "gpt"
SAVE_AT = 2
TOTAL = 5
MODES = ["owner_fsdp", "owner_ddp", "sharded"]


def run_save(rank, world, root, modes=MODES):
    """Train TOTAL steps, saving after SAVE_AT; the final weights and what the ranks saved."""
    out = {}
    for mode in modes:
        model, forward, opt, ded = setup(mode, NAME, world)
        train_range(NAME, forward, opt, rank, world, 0, SAVE_AT)
        keys = sorted(
            f"{fqn}.{k}"
            for fqn, st in checkpoint.optimizer_state_dict(model, opt)["state"].items()
            for k in st
        )
        checkpoint.save(os.path.join(root, mode), model, opt, extra={"step": SAVE_AT})
        train_range(NAME, forward, opt, rank, world, SAVE_AT, TOTAL)
        if ded is not None:
            ded.wait()
        out[mode] = {"params": full_params(model), "keys": keys}
        dist.barrier()
    return out


def run_resume(rank, world, root, modes=MODES):
    """Load each mode's checkpoint at this world size and train to TOTAL."""
    out = {}
    for mode in modes:
        model, forward, opt, ded = setup(mode, NAME, world)
        extra = checkpoint.load(os.path.join(root, mode), model, opt)
        train_range(NAME, forward, opt, rank, world, extra["step"], TOTAL)
        if ded is not None:
            ded.wait()
        out[mode] = full_params(model)
        dist.barrier()
    return out


def single_resume(path, load_optimizer=True):
    torch.manual_seed(0)
    model, forward, opt, _ = setup("single", NAME, 1)
    if load_optimizer:
        extra = checkpoint.load(path, model, opt)
    else:  # only the weights: a fresh optimizer (the non-vacuity check)
        extra = checkpoint.load(path, model, DMuon(param_groups(model), **OPT))
        opt = DMuon(param_groups(model), **OPT)
    train_range(NAME, forward, opt, 0, 1, extra["step"], TOTAL)
    return full_params(model)


def test_dcp_checkpoint_at_4_ranks_resumes_at_2_and_at_1(tmp_path):
    root = str(tmp_path)
    saved = run_on_ranks(run_save, 4, args=(root,), timeout=300)
    for mode in MODES:
        for rank in range(4):  # rank-symmetric keys: every rank names every entry
            assert saved[rank][mode]["keys"] == saved[0][mode]["keys"], mode
    _assert_owner_state_saved_once(os.path.join(root, "owner_fsdp"))
    resumed = run_on_ranks(run_resume, 2, args=(root,), timeout=300)
    for mode in MODES:
        expected = saved[0][mode]["params"]
        for rank in range(2):
            diff, where = max_diff(resumed[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode} at 2 ranks, rank {rank}: {where} off by {diff:.2e}"
        single = single_resume(os.path.join(root, mode))
        diff, where = max_diff(single, expected)
        assert diff <= TOLERANCE, f"{mode} in one process: {where} off by {diff:.2e}"
    weights_only = single_resume(os.path.join(root, "owner_fsdp"), load_optimizer=False)
    miss, _ = max_diff(weights_only, saved[0]["owner_fsdp"]["params"])
    assert miss > 100 * TOLERANCE, "the optimizer state made no difference: the test proves nothing"


def test_dcp_checkpoint_at_2_ranks_resumes_at_4(tmp_path):
    # the world grows: ranks 2 and 3 own matrices no saved rank held, and read them from
    # the pieces ranks 0 and 1 wrote; replicated mode (stock DDP) included
    modes = [*MODES, "replicated"]
    root = str(tmp_path)
    saved = run_on_ranks(run_save, 2, args=(root, modes), timeout=300)
    resumed = run_on_ranks(run_resume, 4, args=(root, modes), timeout=300)
    for mode in modes:
        for rank in range(4):
            diff, where = max_diff(resumed[rank][mode], saved[0][mode]["params"])
            assert diff <= TOLERANCE, f"{mode} at 4 ranks, rank {rank}: {where} off by {diff:.2e}"


def _assert_owner_state_saved_once(path):
    """Each owner-held momentum is stored once: its pieces cover it exactly."""
    import math

    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    momenta = [
        k for k in md if k.startswith("optim.state.blocks.") and k.endswith("momentum_buffer")
    ]
    assert momenta, sorted(md)[:20]
    for key in momenta:
        chunks = md[key].chunks
        stored = sum(math.prod(c.sizes) for c in chunks)
        assert stored == math.prod(md[key].size), (
            f"{key}: {stored} elements stored for {md[key].size}"
        )


def test_hsdp_owner_mode_checkpoint_resumes_as_hsdp_as_fsdp2_and_in_one_process(tmp_path):
    """Owner mode under HSDP (2 replicas × 2 shards, the ranks laid out column-major so
    that an owner slot is not its global rank; ``holdings`` names each owner by its
    global rank): the DCP checkpoint at step 2 resumes under HSDP at 4 ranks, as FSDP2
    owner mode at 2 ranks (another plan) and in one process, each equal to the
    uninterrupted run. Refused before ("each owner slot spans a replicate group")."""
    root = str(tmp_path)
    saved = run_on_ranks(run_save, 4, args=(root, ["owner_hsdp"]), timeout=300)
    expected = saved[0]["owner_hsdp"]["params"]
    for rank in range(4):
        assert saved[rank]["owner_hsdp"]["keys"] == saved[0]["owner_hsdp"]["keys"]
    path = os.path.join(root, "owner_hsdp")
    _assert_owner_state_saved_once(path)
    resumed = run_on_ranks(run_resume, 4, args=(root, ["owner_hsdp"]), timeout=300)
    for rank in range(4):
        diff, where = max_diff(resumed[rank]["owner_hsdp"], expected)
        assert diff <= TOLERANCE, f"HSDP at 4 ranks, rank {rank}: {where} off by {diff:.2e}"
    os.symlink(path, os.path.join(root, "owner_fsdp"))  # the same checkpoint, read as FSDP2's
    resumed = run_on_ranks(run_resume, 2, args=(root, ["owner_fsdp"]), timeout=300)
    for rank in range(2):
        diff, where = max_diff(resumed[rank]["owner_fsdp"], expected)
        assert diff <= TOLERANCE, f"FSDP2 at 2 ranks, rank {rank}: {where} off by {diff:.2e}"
    diff, where = max_diff(single_resume(path), expected)
    assert diff <= TOLERANCE, f"HSDP checkpoint in one process: {where} off by {diff:.2e}"
