"""numpy scalars are hyperparameters like Python numbers (torch's optimizers take them):
``DMuon(lr=np.float32(...))``, ``ns_steps=np.int64(5)``, and a schedule that writes
``np.float32`` into ``group["lr"]`` between steps. Before, each was refused as "must be a
finite real number, got np.float32(0.001)". bools stay refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dmuon.optim import DMuon


def _run(lr, momentum, ns_steps, weight_decay, later_lr) -> torch.Tensor:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 4))
    opt = DMuon(
        [w],
        lr=lr,
        momentum=momentum,
        ns_steps=ns_steps,
        weight_decay=weight_decay,
        ns_compute_dtype="float32",
    )
    for t in range(3):
        w.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(t))
        opt.step()
        opt.param_groups[0]["lr"] = later_lr
    return w.detach().clone()


def test_numpy_scalars_train_as_python_numbers():
    want = _run(1e-3, 0.9, 5, 0.125, 5e-4)
    got = _run(np.float32(1e-3), np.float32(0.9), np.int64(5), np.float16(0.125), np.float32(5e-4))
    # each numpy value is the float of itself: np.float32(1e-3) is 1e-3 rounded to fp32
    exact = _run(float(np.float32(1e-3)), float(np.float32(0.9)), 5, 0.125, float(np.float32(5e-4)))
    assert torch.equal(got, exact)
    assert torch.allclose(got, want, atol=1e-6)


def test_bools_stay_refused():
    with pytest.raises(ValueError, match="lr must be a finite real number"):
        DMuon([nn.Parameter(torch.randn(4, 4))], lr=True)
    with pytest.raises(ValueError, match="ns_steps must be an integer"):
        DMuon([nn.Parameter(torch.randn(4, 4))], ns_steps=np.bool_(True))
