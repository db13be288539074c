"""Owner mode's non-finite check reads only the gradients no launch has vouched for.

As backward hands each layer's gradients to the reduction (``engine/reduction.py``), its
launch copies them into the layer's buckets; one sum per bucket, taken there before the
collectives write the buckets, proves every entry finite when it is finite (a NaN or
Inf entry makes the sum NaN or Inf). The step's agreement (``engine/guards.py``) then
reads only the gradients no launch proved finite, where it read every gradient before.
Checked here on 2 gloo ranks, the ``ddp.dedicate`` replacement, a gradient poisoned on
rank 1 by a tensor hook (so it arrives through backward, as a real one does):

* a clean backward: every gradient is vouched for, and the step runs;
* a NaN entry: the poisoned layer is not vouched for, and the step raises
  :class:`~dmuon.optim.NonFiniteGradientError` on both ranks, naming rank 1 and, on rank
  1, exactly the poisoned parameter — what reading every gradient gives;
* two finite entries of 3e38, whose fp32 sum overflows: the layer is not vouched for,
  the gradient is read again, found finite, and the step runs (a sum that overflows
  proves nothing either way);
* ``free_local_grads`` (``fsdp.dedicate``, torchtitan's owner mode): the launches
  release the local gradients, so each one's own norm at the copy is the only proof
  left: a clean backward vouches for every dedicated matrix; a NaN or Inf in one
  dedicated matrix's gradient on rank 1 alone raises
  :class:`~dmuon.optim.NonFiniteGradientError` on both ranks (naming the matrix on rank
  1) under ``nonfinite="raise"`` and skips the step on both under ``"skip_step"``; either
  way the weights after the next (clean) step are exactly those of a run that never saw
  the poisoned batch. Before, the released gradients were left out of the check with no
  proof, and the NaN reached the weights on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks

POISONED_RANK = 1
CASES = ("clean", "nan", "overflow", "free_local_grads")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4))


def _runs(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {case: _run(rank, case) for case in CASES}


def _run(rank: int, case: str) -> dict[str, Any]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, NonFiniteGradientError, param_groups

    torch.manual_seed(0)
    model = _model()
    if case == "free_local_grads":  # FSDP2's dedication
        from torch.distributed.fsdp import fully_shard

        from dmuon.integrations import fsdp

        ded = fsdp.dedicate(model, layer_pack_mb=0, free_local_grads=True)
        fully_shard(model, ignored_params=set(ded.params))
    else:
        ded = ddp.dedicate(model, layer_pack_mb=0)
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02, nonfinite="raise")
    target = model[2].weight

    def poison(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        if case == "nan":
            g[0, 0] = float("nan")
        else:  # finite entries whose fp32 sum is Inf
            g[0, 0] = g[0, 1] = 3e38
        return g

    if rank == POISONED_RANK and case in ("nan", "overflow"):
        target.register_hook(poison)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    vouched = opt.engine.exchange.reduction.finite_at_launch()
    names = {id(p): n for n, p in model.named_parameters()}
    error = None
    try:
        opt.step()
    except NonFiniteGradientError as err:
        error = {"ranks": err.ranks, "names": err.names}
    engine_name = next(e.name for e in opt.engine.params if e.param is target)
    return {
        "vouched": sorted(names[i] for i in vouched),
        "with_grad": sorted(n for n, p in model.named_parameters() if p.grad is not None),
        "error": error,
        "target": engine_name,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return run_on_ranks(_runs, 2, timeout=180)  # every case in one start of the ranks


@pytest.mark.parametrize("case", CASES)
def test_the_step_reads_only_the_gradients_no_launch_vouched_for(results, case):
    everything = sorted(n for n, _ in _model().named_parameters())
    poisoned_layer = ["2.bias", "2.weight"]
    for rank, runs in enumerate(results):
        r = runs[case]
        where = f"{case}, rank {rank}"
        if case == "free_local_grads":  # FSDP2 holds the rest: only the matrices are DMuon's
            assert r["vouched"] == ["0.weight", "2.weight", "3.weight"], where
        elif case == "clean" or rank != POISONED_RANK:
            assert r["vouched"] == everything, where
        else:
            assert r["vouched"] == [n for n in everything if n not in poisoned_layer], where
        if case == "nan":
            assert r["error"] is not None, f"{where}: the NaN gradient was not refused"
            assert r["error"]["ranks"] == [POISONED_RANK], where
            expected = [r["target"]] if rank == POISONED_RANK else []
            assert r["error"]["names"] == expected, where
        else:
            assert r["error"] is None, f"{where}: {r['error']}"
            assert r["finite"], where


# ---------------------------------------------------------------------------------------
# free_local_grads: a NaN/Inf in a released gradient on one rank, under both policies

FREE_CASES = [(policy, bad) for policy in ("raise", "skip_step") for bad in ("nan", "inf")]


def _free_runs(rank: int, world: int) -> dict[str, dict[str, Any]]:
    runs = {f"{policy}-{bad}": _free_run(rank, policy, bad) for policy, bad in FREE_CASES}
    runs["reference"] = _free_run(rank, "raise", None)  # the poisoned batch never seen
    runs["raise-overflow"] = _free_run(rank, "raise", "overflow")
    return runs


def _free_run(rank: int, policy: str, bad: str | None) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp
    from dmuon.optim import DMuon, NonFiniteGradientError, param_groups

    torch.manual_seed(0)
    model = _model()
    ded = fsdp.dedicate(model, free_local_grads=True)
    fully_shard(model, ignored_params=set(ded.params))
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02, nonfinite=policy)
    target = model[2].weight  # a dedicated matrix: its gradient is released at its launch
    poisoned = [False]

    def poison(g: torch.Tensor) -> torch.Tensor:
        if not poisoned[0]:
            return g
        g = g.clone()
        if bad == "overflow":  # finite entries whose fp32 ℓ1 norm (not max norm) overflows
            g[1, 2] = g[1, 3] = 3e38
        else:
            g[1, 2] = float(bad)  # type: ignore[arg-type]
        return g

    if rank == POISONED_RANK:
        target.register_hook(poison)

    def batch(seed: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * seed + rank))
        model(x).square().mean().backward()

    error = None
    batch(1)
    opt.step()
    opt.zero_grad()
    if bad is not None:
        poisoned[0] = True
        batch(2)
        poisoned[0] = False
        try:
            opt.step()
        except NonFiniteGradientError as err:
            error = {"ranks": err.ranks, "names": err.names}
        opt.zero_grad()
    batch(3)
    opt.step()
    opt.zero_grad()
    ded.wait()
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return {
        "error": error,
        "skipped": opt.skipped_steps,
        "target": next(e.name for e in opt.engine.params if e.param is target),
        "weights": weights,
    }


@pytest.fixture(scope="module")
def free_results() -> list[dict[str, dict[str, Any]]]:
    return run_on_ranks(_free_runs, 2, timeout=240)  # every case in one start of the ranks


@pytest.mark.parametrize(("policy", "bad"), FREE_CASES)
def test_a_nonfinite_released_gradient_on_one_rank_is_caught_on_every_rank(
    free_results, policy, bad
):
    for rank, runs in enumerate(free_results):
        r, ref = runs[f"{policy}-{bad}"], runs["reference"]
        where = f"{policy}, {bad}, rank {rank}"
        if policy == "raise":
            assert r["error"] is not None, f"{where}: the {bad} gradient was not refused"
            assert r["error"]["ranks"] == [POISONED_RANK], where
            expected = [r["target"]] if rank == POISONED_RANK else []
            assert r["error"]["names"] == expected, where
            assert r["skipped"] == 0, where
        else:
            assert r["error"] is None, f"{where}: {r['error']}"
            assert r["skipped"] == 1, f"{where}: the step with the {bad} gradient was not skipped"
        for name, w in r["weights"].items():
            assert bool(torch.isfinite(w).all()), f"{where}: {name} is not finite"
            assert torch.equal(w, ref["weights"][name]), (
                f"{where}: {name} differs from the run without the batch"
            )


def test_finite_released_gradients_whose_sum_would_overflow_are_stepped(free_results):
    """Two entries of 3e38 (finite) in a released gradient on one rank: the launch's
    proof is a max norm, which cannot overflow, so the step runs on every rank. With an
    ℓ1 norm the sum overflowed and the finite gradient was refused as non-finite."""
    for rank, runs in enumerate(free_results):
        r = runs["raise-overflow"]
        assert r["error"] is None, f"rank {rank}: refused {r['error']}"
        assert r["skipped"] == 0, rank
