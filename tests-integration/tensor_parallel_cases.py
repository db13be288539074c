"""A tensor-parallel model and its one-process reference, shared by the tests of
``single``, ``replicated`` and ``sharded`` mode on tensor-parallel meshes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from distributed_cases import CHECK
from torch import nn

from dmuon.optim import DMuon, param_groups

OPT = dict(lr=0.02, weight_decay=0.01, momentum=0.9, ns_compute_dtype=torch.float32, **CHECK)
STEPS = 3
# The whole-matrix Gram iteration against the shard-wise one with a restart at every
# step where the Gram side is the long one: same polar factor in exact arithmetic,
# fp32 rounding apart: 4.5e-8 measured after 3 steps; a shard orthogonalised as if it
# were the whole matrix is off by ~lr = 2e-2.
SPLIT_TOLERANCE = 1e-6


def error(fn) -> str | None:
    """The message of the ``ValueError``/``TypeError`` ``fn()`` raises (``None``: none)."""
    try:
        fn()
    except (ValueError, TypeError) as err:
        return str(err)
    return None


class DeepMLP(nn.Module):
    """Four layers, alternately colwise and rowwise on 2 ranks, every split uneven:

    ==========  ============  =============  ============================
    layer       weight        split          Gram side (the unsplit one)
    ==========  ============  =============  ============================
    fc1 (col)   5 × 12        rows 3 + 2     12, the long side
    fc2 (row)   6 × 5         columns 3 + 2  6, the long side
    fc3 (col)   15 × 6        rows 8 + 7     6, the short side
    fc4 (row)   6 × 15        columns 8 + 7  6, the short side
    ==========  ============  =============  ============================
    """

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.fc1 = nn.Linear(12, 5)
            self.fc2 = nn.Linear(5, 6)
            self.fc3 = nn.Linear(6, 15)
            self.fc4 = nn.Linear(15, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        return self.fc4(F.relu(self.fc3(h)))


def mode_mesh(mode: str, world: int):
    """``(mesh, tp, rows, row)`` of a tensor-parallel test in ``mode``: ``single`` on a tp
    mesh of ``world``; ``replicated`` and ``owner`` on dp 2 × tp ``world/2`` (the dp rows
    each take ``1/rows`` of every batch; ``row`` is this rank's)."""
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "single":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return mesh, mesh, 1, 0
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    return mesh, mesh["tp"], 2, mesh.get_coordinate()[0]


def deep_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + t)
    return torch.randn(16, 12, generator=g), torch.randn(16, 6, generator=g)


# Rules whose every link acts on a shard (Rule.splits), some with a non-default option.
# AdaMuon is not here: on this model its step is decided by rounding in one process
# already (its first update is ≈ sign(O), and O = polar(sign(M)) has entries at the
# rounding level: the Gram and the standard iteration differ by 6e-3 in fc3.weight
# after 3 steps); tests/test_matrix_split.py checks it on generic matrices.


def tp_deep_mlp(mesh):
    """DeepMLP split over ``mesh``. The splits are uneven, so the activations between the
    layers go replicated: torch's styles infer an uneven ``Shard(-1)`` activation's
    global size from the local one."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    colwise = ColwiseParallel(output_layouts=Replicate())
    rowwise = RowwiseParallel(input_layouts=Replicate())
    model = DeepMLP()
    parallelize_module(
        model, mesh, {"fc1": colwise, "fc2": rowwise, "fc3": colwise, "fc4": rowwise}
    )
    return model


def train_steps(model, opt, steps) -> None:
    for t in steps:
        x, y = deep_batch(t)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


CLIP = 0.1  # below the gradients' norm (≈ 0.26 here): every step is clipped


def clipped_reference(rule: str, options: dict) -> tuple[dict[str, torch.Tensor], list[float]]:
    from dmuon.optim import clip_grad_norm_

    model = DeepMLP()
    opt = DMuon(param_groups(model), rule=rule, **OPT, **options)
    norms = []
    for t in range(STEPS):
        x, y = deep_batch(t)
        F.mse_loss(model(x), y).backward()
        norms.append(float(clip_grad_norm_(opt, CLIP)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


class SequenceParallelNet(nn.Module):
    """A residual block with a ``SequenceParallel`` LayerNorm: its weight's gradient is a
    pending sum (``Partial``) over tp, each rank's part of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            self.norm = nn.LayerNorm(8)
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


def sequence_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + t)
    return torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)


SP_OPT = dict(OPT, adamw_lr=0.05)
SP_CLIP = 0.05  # below every step's norm (≈ 0.7–0.9)
SP_VALUE = 0.02  # below the largest gradient elements: clip_grad_value_ clamps some
