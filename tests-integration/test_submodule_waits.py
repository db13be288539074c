"""Owner mode (ZeRO-2-like): a submodule called directly right after ``opt.step()``
reads the owners' new weights, as the layer's own forward does.

Before: only each layer's module (a block) had the forward pre-hook that waits for the
layer's broadcasts, so ``model.blocks[1].fc(h)`` called alone (a probe, partial
inference) read the weights of the step before on the rank that does not own them. Now
every module holding a dedicated weight waits for its layer. Checked against the same
call after ``ded.wait()``, per layer and with small layers packed together; rank 0's
broadcasts leave late, so that rank 1 reads before they land.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _interrupted_forward(model: nn.Module, x: torch.Tensor) -> None:
    """An eval forward of each block interrupted inside it by a ``KeyboardInterrupt``
    (Ctrl-C in a notebook): torch runs no forward hook for a ``BaseException`` that is not
    an ``Exception``, so the block's forward never ends as far as its hooks know."""

    def interrupt(*_: object) -> torch.Tensor:
        raise KeyboardInterrupt

    for block in model.blocks:
        block.proj.forward = interrupt
        try:
            with torch.no_grad():
                block(x)
        except KeyboardInterrupt:
            pass
        del block.proj.forward  # the class's forward again


def _probe(rank: int, world: int, pack_mb: float, interrupted: bool = False) -> list[float]:
    from dmuon.integrations import ddp

    model = Net()
    ded = ddp.dedicate(model, layer_pack_mb=pack_mb)
    opt = DMuon(param_groups(model), lr=0.05, distributed=ded, timeout=20)
    if rank == 0:  # rank 0's broadcasts leave late: rank 1's read comes before they land
        publication = ded.exchange.publication
        publish = publication.publish

        def late(key: str) -> None:
            time.sleep(0.2)
            publish(key)

        publication.publish = late  # type: ignore[method-assign]
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    gaps = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        if interrupted:
            _interrupted_forward(model, x)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            leaves = [model.blocks[i].fc(h) for i in range(2)]  # right after the step
            ded.wait()  # every broadcast landed: the current weights, read however
            current = [model.blocks[i].fc(h) for i in range(2)]
        gaps.append(max((a - b).abs().max().item() for a, b in zip(leaves, current, strict=True)))
    return gaps


@pytest.mark.parametrize("pack_mb", [0, 1.0])
def test_submodule_called_after_step_reads_current_weights(pack_mb: float):
    for rank, gaps in enumerate(run_on_ranks(_probe, WORLD, args=(pack_mb,), timeout=60)):
        assert gaps == [0.0, 0.0], f"rank {rank}: {gaps}"


def test_a_forward_interrupted_by_keyboard_interrupt_does_not_skip_the_next_wait():
    # Before: the interrupted block's "entered" mark stayed set, and after the next step
    # rank 1's direct call of blocks[i].fc skipped its wait and read the old weights.
    results = run_on_ranks(_probe, WORLD, args=(0, True), timeout=60)
    for rank, gaps in enumerate(results):
        assert gaps == [0.0, 0.0], f"rank {rank}: {gaps}"
