"""The averaged gradient a step leaves on its owner, not zeroed before the next step.

After an owner-mode step the owner's ``p.grad`` of each matrix is the averaged gradient
(a view of the reduction's bucket) and the other ranks hold none. A backward without
``zero_grad()`` between (or a second ``step()`` without a backward) sent that average to
the owner again as if it were the owner's own gradient, averaged with the others' new
ones: the owner stepped with ``avg₁/N + avg₂`` where one process steps with
``avg₁ + avg₂`` (found by a review of training loops: 2e-3 off after two steps, under
``ddp.dedicate`` and ``fsdp.dedicate``, silently). It is now refused on every rank by the
step's agreement, with :class:`~dmuon.optim.StaleGradientError` naming the fix, nothing
updated; after ``zero_grad()`` the run goes on as one process that dropped that batch.

Every way of zeroing between steps stays allowed: ``opt.zero_grad()`` (to ``None`` or in
place), ``model.zero_grad(set_to_none=False)`` (the owner's view zeroed in place, then
accumulated into: two versions, never one), and ``zero_grad`` before a second ``step()``.
"""

from __future__ import annotations

import pytest
import torch
from distributed_cases import full_params, max_diff
from test_gradient_lifecycle import OPT, TOLERANCE, WORLD, Net, dedicated, loss

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, StaleGradientError, param_groups

CASES = ("backward_without_zero_grad", "step_twice")


def reference(zeroing: str) -> dict[str, torch.Tensor]:
    """One process: three steps on their global batches, zeroed as ``zeroing`` says."""
    model = Net()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(3):
        (sum(loss(model, t, r) for r in range(WORLD)) / WORLD).backward()
        opt.step()
        if zeroing == "model_in_place":
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad(set_to_none=zeroing == "opt_none")
    return full_params(model)


def run_refused(rank: int, world: int, setup: str, case: str) -> dict[str, object]:
    model = Net()
    ded = dedicated(setup, model, world)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    loss(model, 0, rank).backward()
    opt.step()
    if case == "backward_without_zero_grad":
        loss(model, 1, rank).backward()
    else:
        ded.wait()  # the first step's broadcasts (a forward would wait for them)
    before = {n: p.detach().clone() for n, p in full_params(model).items()}
    error = None
    try:
        opt.step()
    except StaleGradientError as err:
        error = str(err)
    unchanged = max_diff(full_params(model), before)[0] == 0.0
    opt.zero_grad()  # the refused iteration is spent; the run goes on
    for t in (2, 3):
        loss(model, t, rank).backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    return {"error": error, "unchanged": unchanged, "params": full_params(model)}


def refused_reference(case: str) -> dict[str, torch.Tensor]:
    """One process that took step 0, then (the refused iteration dropped) steps 2 and 3."""
    model = Net()
    opt = DMuon(param_groups(model), **OPT)
    for t in (0, 2, 3):
        (sum(loss(model, t, r) for r in range(WORLD)) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


@pytest.mark.parametrize("setup", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", CASES)
def test_a_stale_gradient_is_refused_on_every_rank(setup, case):
    expected = refused_reference(case)
    out = run_on_ranks(run_refused, WORLD, args=(setup, case), timeout=120)
    for rank, r in enumerate(out):
        assert r["error"] is not None, f"{setup} {case}: rank {rank} stepped"
        assert "Call opt.zero_grad() after each opt.step()" in r["error"], r["error"]
        assert r["unchanged"], f"rank {rank}: the refused step moved a parameter"
        diff, where = max_diff(r["params"], expected)
        assert diff <= TOLERANCE, f"{setup} {case}, rank {rank}: {where} differs by {diff:.2e}"


def run_zeroed(rank: int, world: int, zeroing: str) -> dict[str, torch.Tensor]:
    model = Net()
    ded = dedicated("ddp", model, world)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    for t in range(3):
        loss(model, t, rank).backward()
        opt.step()
        if zeroing == "model_in_place":
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad(set_to_none=zeroing == "opt_none")
    ded.wait()
    return full_params(model)


@pytest.mark.parametrize("zeroing", ["opt_none", "opt_in_place", "model_in_place"])
def test_every_way_of_zeroing_between_steps_is_allowed(zeroing):
    expected = reference(zeroing)
    for rank, got in enumerate(run_on_ranks(run_zeroed, WORLD, args=(zeroing,), timeout=120)):
        diff, where = max_diff(got, expected)
        assert diff <= TOLERANCE, f"{zeroing}, rank {rank}: {where} differs by {diff:.2e}"
