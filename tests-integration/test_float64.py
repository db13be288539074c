"""A float64 model trains, clips, saves and loads like a float32 one.

Before: three norms were taken with ``torch._foreach_norm(..., dtype=torch.float32)``,
which refuses a float64 input ("the dtype of the input (Double) should be convertible
without narrowing"): ``opt.load_state_dict(opt.state_dict())`` (the state's finiteness
check), ``clip_grad_norm_(opt, max_norm)`` with ``p = 2``, and the first step after
``fsdp.dedicate(model, free_local_grads=True)`` (the released gradients' norms). Each
norm is now taken in float32, or in float64 for a float64 tensor; float32, bfloat16 and
float16 tensors take the float32 norm they always took.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, clip_grad_norm_, param_groups


def _model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _batch(model: nn.Module, seed: int = 1) -> None:
    dtype = next(model.parameters()).dtype
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    model(x).square().mean().backward()


def _opt(model: nn.Module, **kw: Any) -> DMuon:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DMuon(param_groups(model), **kw)


def test_a_float64_optimizer_loads_its_own_state_dict() -> None:
    model = _model()
    opt = _opt(model)
    _batch(model)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["momentum_buffer"].dtype == torch.float64
    opt.load_state_dict(sd)
    fresh = _opt(model)
    fresh.load_state_dict(sd)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(fresh.state[p][k], v)


def test_float64_state_past_float32_range_loads_and_nan_is_refused() -> None:
    # the check is float64's: 1e300 is finite there (a float32 norm would call it Inf)
    model = _model()
    opt = _opt(model)
    _batch(model)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["momentum_buffer"][0, 0] = 1e300
    opt.load_state_dict(sd)
    sd["state"][0]["momentum_buffer"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'momentum_buffer' of parameter '0\.weight'.*NaN"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_clip_grad_norm_of_a_float64_model(norm_type: float) -> None:
    model, ref = _model(), _model()
    opt = _opt(model)
    _batch(model)
    _batch(ref)
    got = clip_grad_norm_(opt, 0.1, norm_type)
    want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.1, norm_type)
    assert got.dtype == torch.float32  # as documented, whatever the gradients' dtype
    assert torch.allclose(got.double(), want, rtol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clip_grad_norm_of_narrower_models_is_unchanged(dtype: torch.dtype) -> None:
    # the one fp32 foreach norm, as before: the same bits
    model = _model(dtype)
    opt = _opt(model)
    _batch(model)
    counted, copies, _ = opt.engine.norm_parts()  # what the clip counts, in its order
    norms = torch._foreach_norm([g.detach() for g in counted], 2.0, dtype=torch.float32)
    want = (torch.stack(norms).pow(2.0) / torch.tensor(copies)).sum().pow(0.5)
    assert torch.equal(clip_grad_norm_(opt, 1e9), want)


def _dedicated_float64(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp
    from dmuon.optim import NonFiniteGradientError

    out: dict[str, Any] = {}
    model = _model()
    ded = fsdp.dedicate(model, free_local_grads=True)
    fully_shard(model, ignored_params=set(ded.params))  # the biases: FSDP2's
    opt = DMuon(param_groups(model), distributed=ded, ns_compute_dtype="float64")
    _batch(model)  # the same batch on every rank: the average is this gradient
    opt.step()
    opt.zero_grad()
    out["weights"] = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    model[2].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    _batch(model, seed=2)
    try:
        opt.step()
        out["nan"] = "stepped"
    except NonFiniteGradientError as e:
        out["nan"] = str(e)
    return out


def test_a_float64_model_steps_with_free_local_grads() -> None:
    model = _model()
    opt = _opt(model, ns_compute_dtype="float64")
    _batch(model)
    opt.step()
    want = dict(model.named_parameters())
    for out in run_on_ranks(_dedicated_float64, 2, timeout=120):
        for name, w in out["weights"].items():
            assert w.dtype == torch.float64
            assert torch.allclose(w, want[name], rtol=1e-9, atol=1e-12), name
        # the released gradient's float64 norm still tells a NaN
        assert "non-finite" in out["nan"] and "2.weight" in out["nan"]
