"""Tensor-parallel models (issue 14, part 1): placements read, refusals everywhere.

A model parallelised with torch's public ``parallelize_module`` (``ColwiseParallel``:
``Shard(0)``, ``RowwiseParallel``: ``Shard(1)`` on the ``tp`` mesh dimension), alone
on 2 ranks or under FSDP2 on a ``dp`` × ``tp`` mesh of 4, is either stepped
correctly by the mode asked for or refused — on every rank, with an error naming
the parameter, its placements and the mode that takes it — and no rank hangs (the
harness' timeout would fail the test). What sharded mode steps today (rows over one
mesh dimension) still equals one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

OPT = dict(lr=0.02, weight_decay=0.01, momentum=0.9, ns_compute_dtype=torch.float32)
STEPS = 3
# fp32 Newton–Schulz on the same global matrices in both runs; what differs is the
# order of a few sums (the all-to-all reassembles the rows, the Gram products are the
# same), so parameters agree to a few fp32 ulps per step after 3 steps.
TOLERANCE = 1e-5


class MLP(nn.Module):
    """fc1 (8 → 14) then fc2 (14 → 6): non-square, 14 rows/columns split 7 + 7."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc1 = nn.Linear(8, 14)
            self.fc2 = nn.Linear(14, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(16, 8, generator=g), torch.randn(16, 6, generator=g)


def error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def tp_mlp(mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = MLP()
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


def run_refusals_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp, fsdp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tp_mlp(mesh)
    out = {}
    out["detected"] = error(lambda: DMuon(param_groups(model), **OPT))
    for mode in ("single", "replicated", "sharded"):
        out[mode] = error(lambda mode=mode: DMuon(param_groups(model), mode=mode, **OPT))
    out["sign"] = error(lambda: DMuon(param_groups(model), mode="sign", rule="sign_muon"))
    out["ddp.dedicate"] = error(lambda: ddp.dedicate(tp_mlp(mesh)))
    out["fsdp.dedicate"] = error(lambda: fsdp.dedicate(tp_mlp(mesh), mesh))
    return out


COLWISE = "(Shard(dim=0),) on mesh dims ('tp',)"
ROWWISE = "(Shard(dim=1),) on mesh dims ('tp',)"


def test_every_mode_refuses_a_tensor_parallel_mlp_on_every_rank():
    for rank, out in enumerate(run_on_ranks(run_refusals_tp, 2, timeout=120)):
        for mode in ("detected", "sharded"):
            msg = out[mode]
            assert msg is not None, f"rank {rank}, {mode}: no error"
            assert "'fc2.weight'" in msg and ROWWISE in msg, (rank, mode, msg)
            assert "no execution mode" in msg, (rank, mode, msg)
        for mode in ("single", "replicated", "sign"):
            msg = out[mode]
            assert msg is not None, f"rank {rank}, {mode}: no error"
            assert "'fc1.weight'" in msg and COLWISE in msg, (rank, mode, msg)
            assert f"mode={mode!r}" in msg and "mode='sharded' does" in msg, (rank, mode, msg)
        for how in ("ddp.dedicate", "fsdp.dedicate"):
            msg = out[how]
            assert msg is not None, f"rank {rank}, {how}: no error"
            assert "'fc1.weight'" in msg and COLWISE in msg, (rank, how, msg)


def run_refusals_dp_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_mlp(mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {n: repr(tuple(p.placements)) for n, p in model.named_parameters()}
    out = {"detected": error(lambda: DMuon(param_groups(model), **OPT))}
    for mode in ("single", "replicated", "sharded"):
        out[mode] = error(lambda mode=mode: DMuon(param_groups(model), mode=mode, **OPT))
    return out, placements


def test_fsdp2_over_tensor_parallel_is_refused_on_every_rank():
    for rank, (out, placements) in enumerate(run_on_ranks(run_refusals_dp_tp, 4, timeout=180)):
        for mode, msg in out.items():
            assert msg is not None, f"rank {rank}, {mode}: no error ({placements})"
            assert "'fc1.weight'" in msg, (rank, mode, msg)
            assert "on mesh dims ('dp', 'tp')" in msg, (rank, mode, msg)
            assert "several mesh dimensions" in msg, (rank, mode, msg)


def reference() -> dict[str, torch.Tensor]:
    model = MLP()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        x, y = batch(t)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_colwise_sharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = MLP()
    colwise = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, {"fc1": colwise, "fc2": colwise})
    opt = DMuon(param_groups(model), **OPT)
    assert opt.mode == "sharded"
    for t in range(STEPS):
        x, y = batch(t)  # every TP rank sees the whole global batch
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def test_colwise_rows_in_sharded_mode_equal_one_process():
    expected = reference()
    for rank, got in enumerate(run_on_ranks(run_colwise_sharded, 2, timeout=120)):
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"
