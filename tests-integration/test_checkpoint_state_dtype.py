"""A checkpoint keeps the ``state_dtype`` it was saved with, whatever the optimizer it
loads into was built with (docs/guides/checkpointing.md).

The load restores the checkpoint's groups, ``state_dtype`` included, and rebuilds the
state in that dtype. DCP read each tensor into a target of the *live* optimizer's
dtype first, so an fp32 checkpoint loaded into an optimizer built with
``state_dtype="bfloat16"`` came back fp32 but rounded to bf16 (failed before: the
momentum off by up to 1.3e-4, and the resumed run off the uninterrupted one). The
reference is the uninterrupted fp32 run: same world size, same code path, so
bitwise. One process (DCP and the full state dict) and two ranks (owner mode as a
DDP replacement, sharded mode under FSDP2).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed_cases import OPT, batch, full_params, loss_of, setup
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import checkpoint
from dmuon.optim import DMuon, param_groups


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))


def _train(model: nn.Module, opt: DMuon, start: int, stop: int) -> None:
    for t in range(start, stop):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(t))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _matrix_state(opt: DMuon) -> list[torch.Tensor]:
    return [
        v
        for g in opt.param_groups
        if g["rule"] == "muon"
        for p in g["params"]
        for k, v in opt.state[p].items()
        if k != "step"
    ]


@pytest.mark.parametrize("how", ["dcp", "full"])
def test_fp32_state_loads_exactly_into_an_optimizer_built_with_bf16_state(tmp_path, how):
    straight = _mlp()
    straight_opt = DMuon(param_groups(straight), **OPT)
    _train(straight, straight_opt, 0, 5)

    model = _mlp()
    opt = DMuon(param_groups(model), **OPT)
    _train(model, opt, 0, 3)
    full = checkpoint.full_state_dict(model, opt)
    checkpoint.save(tmp_path, model, opt)
    saved = [v.clone() for v in _matrix_state(opt)]

    resumed = _mlp()
    resumed_opt = DMuon(param_groups(resumed), state_dtype="bfloat16", **OPT)
    if how == "dcp":
        checkpoint.load(tmp_path, resumed, resumed_opt)
    else:
        checkpoint.load_full_state_dict(resumed, resumed_opt, full)
    assert resumed_opt.param_groups[0]["state_dtype"] is None  # the checkpoint's
    for a, b in zip(saved, _matrix_state(resumed_opt), strict=True):
        assert b.dtype == torch.float32
        assert torch.equal(a, b), f"off by {(a - b).abs().max():.2e}"
    _train(resumed, resumed_opt, 3, 5)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


MODES = ["owner_ddp", "sharded"]


def run(rank: int, world: int, root: str) -> dict[str, tuple[dict, dict]]:
    out = {}
    for mode in MODES:
        model, forward, opt, ded = setup(mode, "gpt", world)
        for t in range(3):
            if t == 2:
                checkpoint.save(os.path.join(root, mode), model, opt, extra={"step": t})
            loss_of("gpt", forward, *batch("gpt", t, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        if ded is not None:
            ded.wait()
        straight = full_params(model)
        model, forward, opt, ded = setup(mode, "gpt", world, dict(OPT, state_dtype="bfloat16"))
        start = checkpoint.load(os.path.join(root, mode), model, opt)["step"]
        dtypes = {str(v.dtype) for v in _matrix_state(opt) if v.numel()}
        for t in range(start, 3):
            loss_of("gpt", forward, *batch("gpt", t, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        if ded is not None:
            ded.wait()
        out[mode] = (straight, full_params(model), dtypes)
        dist.barrier()
    return out


def test_fp32_state_resumes_bitwise_at_two_ranks_into_bf16_built_optimizers(tmp_path):
    results = run_on_ranks(run, 2, args=(str(tmp_path),), timeout=180)
    for rank, by_mode in enumerate(results):
        for mode, (straight, resumed, dtypes) in by_mode.items():
            assert dtypes == {"torch.float32"}, (mode, rank, dtypes)
            for name, value in straight.items():
                diff = (value - resumed[name]).abs().max()
                assert torch.equal(value, resumed[name]), f"{mode} rank {rank}: {name} {diff:.2e}"
