"""Gradient clipping and gradient accumulation in every mode equal one process.

``dmuon.optim.clip_grad_norm_`` must count each gradient element once although
matrix gradients live on their owners (owner mode), in row shards (sharded mode)
or on every rank (replicated mode): its total norm equals
``torch.nn.utils.clip_grad_norm_`` on the single-process gradients, and training
with clipping reaches the same parameters. Accumulating two micro-batches, the
first inside ``no_sync()``, equals one process on both micro-batches.
"""

import pytest
import torch
from distributed_cases import OPT, TOLERANCE, batch, build, full_params, loss_of, max_diff, setup

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, clip_grad_norm_, param_groups

NAME = "gpt"
STEPS = 3
MAX_NORM = 0.05  # below the gradient norms of this model: clipping is active


def reference(world, clip, micro):
    model = build(NAME)
    opt = DMuon(param_groups(model), **OPT)
    norms = []
    for t in range(STEPS):
        for k in range(micro):
            losses = [
                loss_of(NAME, model, *batch(NAME, micro * t + k, r, world)) for r in range(world)
            ]
            (sum(losses) / world / micro).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return full_params(model), norms


def run_clip(rank, world, modes):
    out = {}
    for mode in modes:
        model, forward, opt, ded = setup(mode, NAME, world)
        norms = []
        for t in range(STEPS):
            loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
            norms.append(float(clip_grad_norm_(opt, MAX_NORM)))
            opt.step()
            opt.zero_grad()
        if ded is not None:
            ded.wait()
        out[mode] = (full_params(model), norms)
    return out


def run_accumulation(rank, world, modes):
    import contextlib

    out = {}
    for mode in modes:
        model, forward, opt, ded = setup(mode, NAME, world)
        for t in range(STEPS):
            for k in range(2):
                if k == 0 and ded is not None:
                    ctx = ded.no_sync()  # DMuon's reductions and FSDP2's
                elif k == 0:
                    ctx = forward.no_sync()  # stock DDP
                else:
                    ctx = contextlib.nullcontext()
                with ctx:
                    (loss_of(NAME, forward, *batch(NAME, 2 * t + k, rank, world)) / 2).backward()
            opt.step()
            opt.zero_grad()
        if ded is not None:
            ded.wait()
        out[mode] = full_params(model)
    return out


@pytest.mark.parametrize("world", [3])
def test_clipping_counts_every_gradient_once_in_every_mode(world):
    modes = ["owner_fsdp", "owner_ddp", "replicated", "sharded"]
    expected, norms = reference(world, clip=True, micro=1)
    results = run_on_ranks(run_clip, world, args=(modes,), timeout=180)
    for rank in range(world):
        for mode in modes:
            params, got = results[rank][mode]
            assert got == pytest.approx(norms, rel=1e-5), f"{mode}, rank {rank}: norms"
            diff, where = max_diff(params, expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"


def test_accumulating_under_no_sync_equals_one_process_on_both_micro_batches():
    world = 2
    modes = ["owner_fsdp", "owner_ddp", "replicated"]
    expected, _ = reference(world, clip=False, micro=2)
    results = run_on_ranks(run_accumulation, world, args=(modes,), timeout=180)
    for rank in range(world):
        for mode in modes:
            diff, where = max_diff(results[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"
