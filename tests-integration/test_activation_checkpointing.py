"""Owner mode under activation checkpointing (``torch.utils.checkpoint`` around each
block, as Hugging Face's ``gradient_checkpointing_enable()`` does) trains like one process.

The recomputation calls each block again inside backward, so the layer's forward
pre-hook (wait for, or under ZeRO-3-like ``reshard_after_forward`` materialise, the
published weights) and its forward hook (free them again) run a second time, between
the backward pre-hook that brought the weights back and the backward that needs them.
Checked with resident weights and ZeRO-3-like, with the non-reentrant and the
reentrant checkpoint, against one process that checkpoints the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dmuon.comm.testing import run_on_ranks

D, LAYERS, STEPS, BATCH = 16, 3, 3, 8
OPT = dict(lr=0.02, ns_compute_dtype=torch.float32)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 4)
        self.reentrant = reentrant  # None: no checkpointing
        self.calls = 0  # block calls, recomputations included
        for block in self.blocks:
            block.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    # the input requires grad: the reentrant checkpoint computes no parameter gradient
    # of a block whose inputs do not
    return torch.randn(BATCH, D, generator=g).requires_grad_(), torch.randn(BATCH, 4, generator=g)


def train(rank: int, world: int, reentrant: bool | None, reshard: bool) -> dict[str, object]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    model = Net(reentrant)
    ded = ddp.dedicate(model, reshard_after_forward=reshard)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for t in range(STEPS):
        x, y = batch(t)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    ded.wait()  # the last publications (ZeRO-3-like: every layer materialised)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "calls": model.calls}


def one_process(reentrant: bool | None) -> dict[str, torch.Tensor]:
    from dmuon.optim import DMuon, param_groups

    model = Net(reentrant)
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        x, y = batch(t)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("reshard", [False, True], ids=["resident", "zero3"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_owner_mode_under_activation_checkpointing_equals_one_process(reentrant, reshard):
    expected = one_process(reentrant)
    results = run_on_ranks(train, 2, args=(reentrant, reshard), timeout=120)
    for rank, out in enumerate(results):
        # each block ran twice a step: its forward and its recomputation in backward
        assert out["calls"] == 2 * LAYERS * STEPS, (rank, out["calls"])
        for name, want in expected.items():
            diff = (out["weights"][name] - want).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: {name} differs by {diff:.2e}"
