"""Owner mode trains a module called twice (ALBERT-style weight sharing) under the
reentrant checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``, Hugging Face's
``gradient_checkpointing_enable()`` default) like one process.

Each checkpointed segment runs a backward of its own, which accumulates its gradients
into ``p.grad`` when it ends: the shared layer's post-accumulate-grad hooks fire once per
call, so its gradients are complete after the first segment's backward and receive more
in the second's. Owner mode once launched the layer after the first and refused the
second ("a second gradient ... arrived after its layer ... was reduced") on every rank;
now a gradient arriving inside a reentrant backward holds the launch for the outer one.
Checked with resident weights and ZeRO-3-like, against one process that checkpoints the
same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dmuon.comm.testing import run_on_ranks

D, USES, STEPS, BATCH = 16, 2, 2, 8
OPT = dict(lr=0.02, adamw_lr=3e-3, ns_compute_dtype=torch.float32)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = Block()  # one layer, called USES times (ALBERT)


class Albert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = nn.Linear(D, D)
        self.encoder = Encoder()
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(x)
        for _ in range(USES):
            x = checkpoint(self.encoder.layer, x, use_reentrant=True)
        return self.head(x)


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 4, generator=g)


def train(
    rank: int, world: int, reshard: bool | None, pack: float | None = None
) -> dict[str, torch.Tensor]:
    """``reshard=None``: one process, no dedication (the reference); ``pack``: the
    ``layer_pack_mb`` (``None``: the default, which packs this tiny model's layers)."""
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    model = Albert()
    packing = {} if pack is None else {"layer_pack_mb": pack}
    ded = None if reshard is None else ddp.dedicate(model, reshard_after_forward=reshard, **packing)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for t in range(STEPS):
        x, y = batch(t)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    if ded is not None:
        ded.wait()  # the last publications (ZeRO-3-like: every layer materialised)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("reshard", "pack"),
    # layers unpacked: this tiny model's default packing makes one unit, launched last
    [(False, 0), (True, None)],
    ids=["resident", "zero3"],
)
def test_shared_layer_under_reentrant_checkpoint_equals_one_process(
    reshard: bool, pack: float | None
) -> None:
    reference = train(0, 1, None)
    for rank, out in enumerate(run_on_ranks(train, 2, args=(reshard, pack), timeout=120)):
        assert out.keys() == reference.keys()
        for name, want in reference.items():
            # the shared layer's gradient is the sum of both uses, as on one process
            torch.testing.assert_close(
                out[name], want, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}"
            )
