"""``DMuon.unscaled`` ends with a step the loss scaler skips, in every mode.

Documented contract: ``unscaled`` is True from ``opt.unscale_(scaler)`` until the step
those gradients were unscaled for has run, taken or skipped. In ``replicated`` and
``sharded`` mode (as in ``single``) ``scaler.step(opt)`` skips a step with an Inf
without calling ``opt.step()``; in owner and ``sign`` mode it calls it on every rank
and the step skips itself. Two ranks run 3 loss-scaled iterations of the recipe
``if not opt.unscaled: opt.unscale_(scaler)``, clip, ``scaler.step``, ``update``,
``model.zero_grad()`` (which DMuon does not see), iteration 0's loss infinite on every
rank. Expected on every rank, in every mode: ``unscaled`` False after each backward,
True after ``unscale_``, False after ``scaler.step``; and the total norm clipped in
iterations 1 and 2 equals that of a twin run without loss scaling (same model, mode
and batches, iteration 0 dropped), not the scale times it (``sign`` mode does not
clip: its flags only).
"""

from __future__ import annotations

import pytest
import torch
from distributed_cases import batch, loss_of, setup

from dmuon.comm.testing import run_on_ranks

WORLD, ITERATIONS, NAME = 2, 3, "mixed"
MODES = ["replicated", "sharded", "owner_ddp", "sign"]
MAX_NORM = 10.0


def run(rank: int, world: int, mode: str) -> dict[str, list]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from dmuon.optim import clip_grad_norm_

    model, forward, opt, ded = setup(mode, NAME, world)
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=2.0**10)
        if mode == "replicated"
        else ShardedGradScaler(device="cpu", init_scale=2.0**10)
    )
    flags, norms = [], []
    for t in range(ITERATIONS):
        loss = loss_of(NAME, forward, *batch(NAME, t, rank, world))
        if t == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        flags.append(opt.unscaled)
        if not opt.unscaled:
            opt.unscale_(scaler)
        flags.append(opt.unscaled)
        if mode != "sign":  # sign mode clips nothing (its step is a voted sign)
            norm = float(clip_grad_norm_(opt, MAX_NORM))
            if t:
                norms.append(norm)
        scaler.step(opt)
        flags.append(opt.unscaled)
        scaler.update()
        model.zero_grad()
    if ded is not None:
        ded.wait()
    skipped = opt.skipped_steps
    # the twin: no loss scaling, iteration 0 (skipped above) dropped
    model, forward, opt, ded = setup(mode, NAME, world)
    refs: list[float] = []
    for t in range(1, ITERATIONS if mode != "sign" else 1):
        loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
        refs.append(float(clip_grad_norm_(opt, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    if ded is not None:
        ded.wait()
    return {"flags": flags, "norms": norms, "refs": refs, "skipped": skipped}


@pytest.mark.parametrize("mode", MODES)
def test_unscaled_is_false_again_after_a_skipped_step(mode):
    outs = run_on_ranks(run, WORLD, args=(mode,), timeout=120)
    for rank, out in enumerate(outs):
        assert out["flags"] == [False, True, False] * ITERATIONS, (mode, rank, out)
        assert out["norms"] == pytest.approx(out["refs"], rel=1e-5), (mode, rank, out)
        # owner and sign mode count the step they skipped; the others never saw it
        assert out["skipped"] == (1 if mode in ("owner_ddp", "sign") else 0), (mode, out)
