"""A mean over ranks of fp16 gradients does not overflow where the mean is finite.

Each of two ranks holds a gradient of 40000 in fp16 (largest finite value 65504), as a
``GradScaler``'s still-scaled gradients do. Their sum overflows; their mean, 40000, does
not, and DDP (which divides each rank's gradient before its all-reduce) averages it.
DMuon summed first and divided after: owner mode's matrices (reduced to their owner)
and scalars (all-reduced), and ``sign`` mode's scalars, came out ``inf`` and the step
raised ``NonFiniteGradientError``. Now fp16 divides first (``dmuon.comm.averaging``);
the gradients the step reads are the mean, exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import ddp
from dmuon.optim import DMuon, param_groups

G = 40000.0  # per rank; two ranks sum to 80000 > 65504


def run_mode(rank: int, world: int, mode: str) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).half()
    x = torch.ones(1, 4, dtype=torch.float16)
    if mode == "owner":
        ded = ddp.dedicate(model)
        opt = DMuon(param_groups(model), distributed=ded, lr=0.01, ns_compute_dtype="float32")
    else:
        ded = None
        opt = DMuon(param_groups(model), rule="sign_muon", mode="sign", lr=0.01)
    (model(x) * G).sum().backward()  # every gradient entry 40000 on every rank
    grads = {}
    if mode == "owner":
        opt.engine.prepare_grads()  # the reductions finished: the owner's mean in p.grad
    else:

        def keep(optimizer, args, kwargs):  # after sign mode's scalar all-reduce
            grads["bias"] = model.bias.grad.clone()

        opt.register_step_post_hook(keep)
    opt.step()
    if ded is not None:
        ded.wait()
    if mode == "owner":
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {n: g.float() for n, g in grads.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["owner", "sign"])
def test_an_fp16_mean_over_ranks_is_the_mean(mode):
    results = run_on_ranks(run_mode, 2, args=(mode,), timeout=90)
    seen = set()
    for got in results:
        for name, g in got.items():
            seen.add(name)
            assert torch.equal(g, torch.full_like(g, G)), (mode, name, g)
    assert "bias" in seen, results
    if mode == "owner":
        assert "weight" in seen, results  # its owner's reduced gradient
