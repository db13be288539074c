"""The model and data the guides' training scripts share (``ddp.py``, ``fsdp2.py``, ``hsdp.py``,
``tensor_parallel.py``).

A two-block MLP language model over a 64-token vocabulary and a synthetic
next-token task, small enough to train in seconds on CPU processes; the test
suite trains it in one process as the reference the scripts must match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GLOBAL_BATCH", "LAYERS", "SEQ", "VOCAB", "WIDTH", "Block", "Model", "batch"]

VOCAB, WIDTH, LAYERS, SEQ, GLOBAL_BATCH = 64, 64, 2, 16, 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank builds the same model
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, rank: int, world: int, device: torch.device):
    """This rank's rows of the global batch of ``step``: learn y = (3x + 1) mod VOCAB."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows].to(device), ((3 * x + 1) % VOCAB)[rows].to(device)
