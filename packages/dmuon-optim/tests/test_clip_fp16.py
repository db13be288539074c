"""``clip_grad_norm_`` on fp16 gradients whose norm exceeds fp16's largest value.

Every entry of a 64×64 fp16 gradient of 1100s is finite, but its 2-norm, 70400, is not an
fp16 number (the largest is 65504). A per-tensor norm computed in the gradient's dtype is
Inf, the total is Inf, and the clip factor ``max_norm / total`` is 0: every gradient was
zeroed. The norms are taken in fp32 (as the returned total, a 0-D float32 tensor, already
was), on one process and in owner mode, where each owner's partial sum is all-reduced.
The reference is :func:`torch.nn.utils.clip_grad_norm_` on the same gradients upcast to
fp32, the clipped result rounded back to fp16.
"""

import pytest
import torch

from dmuon.comm import MatrixItem, plan_owners
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, OwnerExchange, clip_grad_norm_

MAX_NORM = 1.0


def _grads() -> list[torch.Tensor]:
    """Two fp16 gradients: one of 1100s (norm 70400 > 65504), one of random entries."""
    g = torch.Generator().manual_seed(0)
    small = (torch.randn(64, 32, generator=g) * 100).to(torch.float16)
    return [torch.full((64, 64), 1100.0, dtype=torch.float16), small]


def _reference(grads: list[torch.Tensor], norm_type: float) -> tuple[float, list[torch.Tensor]]:
    """torch's clip on the fp32 upcasts: the total, and the clipped gradients."""
    params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.float()
    total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type)
    return total.item(), [p.grad for p in params]


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_fp16_gradients_past_65504_are_clipped_as_in_fp32(norm_type):
    grads = _grads()
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float16)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = clip_grad_norm_(DMuon(params, lr=0.02), MAX_NORM, norm_type)
    expected, clipped = _reference(grads, norm_type)
    assert expected > 65504  # the case: finite entries, a norm fp16 cannot hold
    assert total.dtype == torch.float32 and total.dim() == 0
    assert total.item() == pytest.approx(expected, rel=1e-5)
    for p, c in zip(params, clipped, strict=True):
        assert bool(p.grad.abs().max() > 0), "the gradient was zeroed"
        torch.testing.assert_close(p.grad, c.to(torch.float16))


def _owner_clip(rank: int, world: int) -> dict[str, object]:
    """Owner mode on 2 ranks: each owns one of the two matrices; both ranks hold the same
    local gradients, so the averaged ones are ``_grads()``."""
    grads = _grads()
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float16)) for g in grads]
    items = [MatrixItem(f"w{i}", tuple(p.shape), p.dtype, f"l{i}") for i, p in enumerate(params)]
    exchange = OwnerExchange(list(zip(items, params, strict=True)), plan=plan_owners(items, 2))
    opt = DMuon(params, lr=0.02, distributed=exchange)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
        exchange.reduction.grad_ready(p)  # what the integrations' hooks report
    total = clip_grad_norm_(opt, MAX_NORM, 2.0)
    return {
        "total": total.item(),
        "dtype": total.dtype,
        "grads": {i: p.grad.clone() for i, p in enumerate(params) if p.grad is not None},
    }


def test_owner_mode_clips_fp16_gradients_past_65504_as_in_fp32():
    results = run_on_ranks(_owner_clip, 2, timeout=120)
    expected, clipped = _reference(_grads(), 2.0)
    held = {}
    for rank, r in enumerate(results):
        assert r["dtype"] == torch.float32, rank
        assert r["total"] == pytest.approx(expected, rel=1e-5), rank
        held.update(r["grads"])
    assert sorted(held) == [0, 1]  # each owner holds its matrix's averaged gradient
    for i, c in enumerate(clipped):
        assert bool(held[i].abs().max() > 0), f"matrix {i}'s gradient was zeroed"
        torch.testing.assert_close(held[i], c.to(torch.float16))
