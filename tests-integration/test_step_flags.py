"""Owner mode's step makes one small all-reduce of flags, not two.

The step's agreement (step numbers, thawed, skip, changed-gradient and non-finite flags,
``engine/guards.py``'s ``agree_step``) travels in the gradient-presence flags'
all-reduce of the reduction's flush (``engine/reduction.py``), which the step makes
anyway: before, each was an all-reduce of its own. Counted here by wrapping
``torch.distributed.all_reduce`` during ``opt.step()`` on 2 gloo ranks (the flags are
the integer all-reduces: every gradient all-reduce is floating point), with the errors
the agreement raises still raised on every rank. A step whose reductions a clip
finished first (the flush ran before ``step()``) keeps the agreement's own all-reduce.

And :func:`dmuon.optim.engine.nonfinite_ranks` refuses a sparse gradient that one rank
holds on every rank: before, the rank holding it raised before the all-reduce, and the
other waited in it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _count_flag_all_reduces(calls: list[str]) -> Any:
    """Wrap ``torch.distributed.all_reduce``: each integer tensor's call is listed."""
    import torch.distributed as dist

    original = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_floating_point():
            calls.append(str(tensor.dtype))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    return original


def _steps(rank: int, world: int, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, clip_grad_norm_, param_groups

    m = _model()
    ded = ddp.dedicate(m)
    opt = DMuon(param_groups(m), distributed=ded, lr=0.02, ns_compute_dtype=torch.float32)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    per_step: list[int] = []
    errors: list[str] = []
    for step in range(3):
        nan = case == "nan" and step == 1 and rank == 1  # NaN gradients from backward
        F.mse_loss(m(x * float("nan") if nan else x), torch.zeros(4, 4)).backward()
        if case == "clip":
            clip_grad_norm_(opt, 1.0)  # finishes the reductions before step()
        calls: list[str] = []
        original = _count_flag_all_reduces(calls)
        try:
            opt.step()
        except RuntimeError as err:
            errors.append(f"{type(err).__name__}: {err}")
        finally:
            dist.all_reduce = original  # type: ignore[assignment]
        per_step.append(len(calls))
        opt.zero_grad()
    ded.wait()
    return {
        "per_step": per_step,
        "errors": errors,
        "weights": [p.detach().clone() for p in m.parameters()],
        "taken": opt.steps_taken,
    }


@pytest.mark.parametrize("case", ["plain", "nan", "clip"])
def test_owner_step_makes_one_flag_all_reduce(case):
    out = run_on_ranks(_steps, 2, args=(case,), timeout=120)
    for r in out:
        # before: [2, 2, 2], but after a clip (its flush carried the presence flags alone,
        # the step the agreement alone)
        assert r["per_step"] == [1, 1, 1], r["per_step"]
    if case == "nan":  # raised on both ranks, alike, and step 1 taken by neither
        for r in out:
            (error,) = r["errors"]
            assert error.startswith(
                "NonFiniteGradientError: DMuon step 2: non-finite (NaN or Inf) gradient on "
                "rank(s) [1]"
            ), error
        assert [r["taken"] for r in out] == [2, 2]
    else:
        assert all(not r["errors"] for r in out)
        assert [r["taken"] for r in out] == [3, 3]
    for a, b in zip(out[0]["weights"], out[1]["weights"], strict=True):
        assert torch.equal(a, b)


def _sparse_refused(rank: int, world: int) -> dict[str, Any]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups
    from dmuon.optim.engine import nonfinite_ranks

    m = _model()
    ded = ddp.dedicate(m)
    opt = DMuon(param_groups(m), distributed=ded, lr=0.02, timeout=30)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    if rank == 1:
        m[1].bias.grad = torch.zeros(16).to_sparse()
    try:
        nonfinite_ranks(opt.engine)
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": None}


def test_nonfinite_ranks_refuses_one_ranks_sparse_gradient_on_every_rank():
    # before: rank 1 raised before the all-reduce, rank 0 waited in it (past this timeout)
    out = run_on_ranks(_sparse_refused, 2, timeout=60)
    for r in out:
        assert r["error"] is not None and "sparse gradients" in r["error"], r
        assert "rank(s) [1]" in r["error"], r
    assert "parameter '1.bias'" in out[1]["error"]  # the rank that holds it names it
