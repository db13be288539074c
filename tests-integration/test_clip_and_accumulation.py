"""Gradient clipping and gradient accumulation in every mode equal one process.

``dmuon.optim.clip_grad_norm_`` must count each gradient element once although
matrix gradients live on their owners (owner mode), in row shards (sharded mode)
or on every rank (replicated mode): its total norm equals
``torch.nn.utils.clip_grad_norm_`` on the single-process gradients, and training
with clipping reaches the same parameters. ``dmuon.optim.clip_grad_value_`` must
clamp the averaged gradient (in owner mode: after the reductions), so training with it
equals one process running ``torch.nn.utils.clip_grad_value_``. Accumulating two
micro-batches, the first inside ``no_sync()``, equals one process on both micro-batches.
"""

import pytest
import torch
from distributed_cases import OPT, TOLERANCE, batch, build, full_params, loss_of, max_diff, setup

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, clip_grad_norm_, clip_grad_value_, param_groups

NAME = "gpt"
STEPS = 3
MAX_NORM = 0.05  # below the gradient norms of this model: clipping is active
MAX_VALUE = 2e-3  # below the largest averaged gradient elements: clamping is active


def reference(world, clip, micro, value=False):
    model = build(NAME)
    opt = DMuon(param_groups(model), **OPT)
    norms = []
    clamped = 0
    for t in range(STEPS):
        for k in range(micro):
            losses = [
                loss_of(NAME, model, *batch(NAME, micro * t + k, r, world)) for r in range(world)
            ]
            (sum(losses) / world / micro).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if value:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            clamped += sum(int((g.abs() > MAX_VALUE).sum()) for g in grads)
            torch.nn.utils.clip_grad_value_(model.parameters(), MAX_VALUE)
        opt.step()
        opt.zero_grad()
    if value:
        assert clamped > 0, "clip_grad_value_ clamped nothing: the test would prove nothing"
    return full_params(model), norms


def run_clip(rank, world, modes, by="norm"):
    """Train each mode with DMuon's clipping ``by`` the norm (recording the norms) or by
    value before every step."""
    out = {}
    for mode in modes:
        model, forward, opt, ded = setup(mode, NAME, world)
        norms = []
        for t in range(STEPS):
            loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
            if by == "norm":
                norms.append(float(clip_grad_norm_(opt, MAX_NORM)))
            else:
                clip_grad_value_(opt, MAX_VALUE)
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


def test_clipping_by_value_clamps_the_averaged_gradient_in_every_mode():
    world = 2
    modes = ["owner_fsdp", "owner_ddp", "replicated", "sharded"]
    expected, _ = reference(world, clip=False, micro=1, value=True)
    results = run_on_ranks(run_clip, world, args=(modes, "value"), timeout=180)
    for rank in range(world):
        for mode in modes:
            diff, where = max_diff(results[rank][mode][0], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"


def test_clip_grad_value_checks_its_argument():
    model = build(NAME)
    opt = DMuon(param_groups(model), **OPT)
    with pytest.raises(ValueError, match=r"clip_value must be ≥ 0, got -1\.0"):
        clip_grad_value_(opt, -1.0)
    with pytest.raises(ValueError, match="clip_value must be ≥ 0, got nan"):
        clip_grad_value_(opt, float("nan"))


def test_accumulating_under_no_sync_equals_one_process_on_both_micro_batches():
    world = 2
    modes = ["owner_fsdp", "owner_ddp", "replicated"]
    expected, _ = reference(world, clip=False, micro=2)
    results = run_on_ranks(run_accumulation, world, args=(modes,), timeout=180)
    for rank in range(world):
        for mode in modes:
            diff, where = max_diff(results[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"
