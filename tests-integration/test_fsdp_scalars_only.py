"""An FSDP2 model whose only parameters are scalars (norms and biases, no matrix).

Mode detection told FSDP2 by DTensor *matrices* only, so on such a model it asked for
``mode='replicated'``, ``'sign'`` or ``'single'`` and never offered the right answer:
FSDP2's parameters are ``Shard(0)`` DTensors whose gradients FSDP2 averages, which is
``sharded`` mode. Now it detects ``sharded`` and trains as one process. Sign mode, which
averages the scalar gradients itself in a flat buffer of local tensors, crashed inside
``FlatBucket.pack`` ("got mixed torch.Tensor and DTensor"); it now refuses such a
parameter up front, on every rank, naming it, its placements and the modes that take it.
Plain matrices beside FSDP2's scalars (the matrices kept out of ``fully_shard`` for a
dedication that was not passed) stay ambiguous: the refusal now names both.
"""

import torch
import torch.nn.functional as F
from distributed_cases import full_params, mean_loss_reference
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

OPT = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3, adamw_eps=1e-3)
STEPS = 3
ROWS = 12  # the global batch, divisible by 2 ranks
TOLERANCE = 1e-6
NAMES = ("first.weight", "first.bias", "second.weight", "second.bias", "shift")


class Norms(nn.Module):
    """Two LayerNorms and a free bias: only scalar (AdamW) parameters."""

    def __init__(self, matrix: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.first = nn.LayerNorm(16)
        self.second = nn.LayerNorm(16)
        self.shift = nn.Parameter(torch.randn(16) / 4)
        self.proj = nn.Linear(16, 16, bias=False) if matrix else None

    def forward(self, x):
        h = self.second(torch.tanh(self.first(x)) + self.shift)
        return self.proj(h) if self.proj is not None else h


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, 16, generator=g)
    y = torch.randn(ROWS, 16, generator=g)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return x[rows], y[rows]


def sharded_model(world, matrix=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Norms(matrix)
    mesh = init_device_mesh("cpu", (world,))
    for module in (model.first, model.second):
        fully_shard(module, mesh=mesh)
    if matrix:  # the matrix kept out of FSDP2, as for a dedication
        fully_shard(model, mesh=mesh, ignored_params={model.proj.weight})
    else:
        fully_shard(model, mesh=mesh)
    return model


def run_detected(rank, world):
    model = sharded_model(world)
    assert all(hasattr(p, "placements") for p in model.parameters())
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        x, y = batch(t, rank, world)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt.mode, full_params(model)


def reference(world):
    model = Norms()
    return mean_loss_reference(model, DMuon(param_groups(model), **OPT), batch, STEPS, world)


def test_fsdp2_scalars_alone_are_detected_as_sharded_and_train_as_one_process():
    expected = reference(2)
    results = run_on_ranks(run_detected, 2, timeout=90)
    for rank, (mode, got) in enumerate(results):
        assert mode == "sharded", (rank, mode)
        for name, value in got.items():
            diff = float((value - expected[name]).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"
            assert torch.equal(value, results[0][1][name]), f"rank {rank} != rank 0: {name}"


def run_refused(rank, world, mode, matrix):
    model = sharded_model(world, matrix)
    kw = dict(OPT, mode=mode) if mode else dict(OPT)
    if mode == "sign":
        kw["rule"] = "sign_muon"
    try:
        DMuon(param_groups(model), **kw)
    except ValueError as e:
        return str(e)
    return None


def test_sign_mode_refuses_fsdp2_scalars_up_front_naming_them():
    for rank, msg in enumerate(run_on_ranks(run_refused, 2, args=("sign", False), timeout=90)):
        assert msg is not None, f"rank {rank}: sign mode took FSDP2's scalar parameters"
        assert any(f"scalar parameter {n!r}" in msg for n in NAMES), msg
        assert "Shard(dim=0)" in msg and "mode='sign' does not step" in msg, msg
        assert "mode='sharded'" in msg and "without fully_shard" in msg, msg


def test_plain_matrices_beside_fsdp2_scalars_stay_ambiguous_and_are_named():
    for rank, msg in enumerate(run_on_ranks(run_refused, 2, args=(None, True), timeout=90)):
        assert msg is not None, f"rank {rank}: a mode was guessed"
        assert "cannot tell how the gradients arrive" in msg, msg
        assert "(e.g. 'proj.weight')" in msg, msg
        assert any(f"FSDP2's (e.g. {n!r})" in msg for n in NAMES), msg
        assert "fsdp.dedicate" in msg, msg
