"""LightningModules for the cases of ``test_lightning.py`` that the examples do not cover.

    python lightning_cases.py --case two_optimizers root_weights --out PREFIX  # 2 processes

Run as a script, Lightning's own launcher starts the second process (``devices=2``,
``strategy=DMuonStrategy()``), and the cases run one after another in that one launch (a
Lightning launch costs ~20 s on two cores, most of it importing Lightning twice). Every
rank saves ``{"params": ...}`` (its final parameters) or ``{"error": "module.Type:
message"}`` (what ``trainer.fit`` raised, after Lightning's teardown) to
``PREFIX.<case>.rank<N>.pt``. A case that is refused must leave the process group usable,
so refused cases run last, the one that stops mid-step (``some_ranks_only``) at the end.
The tests import this module for the models, the data and the per-rank batches, and
train the single-process reference with a plain loop.

Cases:

* ``two_optimizers``: manual optimization with ``configure_optimizers`` returning
  ``[AdamW(biases), DMuon(matrices)]`` (the AdamW first), each clipped by norm with
  ``self.clip_gradients`` and stepped in that order.
* ``root_weights``: a weight matrix the LightningModule holds itself, and a
  ``training_step`` that never calls the module.
* ``adamw_only``: ``configure_optimizers`` returns a plain AdamW (no DMuon) under
  ``DMuonStrategy``: refused on every rank when the optimizers are set up.
* ``some_ranks_only``: a layer the second batch runs on rank 0 only, under
  ``reshard_after_forward=True``: refused on every rank before backward.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from dmuon.optim import DMuon, param_groups

PER_RANK, WORLD = 16, 2
CLIP = 0.05  # below every step's gradient norm here: the clipping changes every step
# DMUON_TEST_CHECK_EVERY: see distributed_cases.CHECK (this script runs on its own)
CHECK = {"check_every": int(v)} if (v := os.environ.get("DMUON_TEST_CHECK_EVERY")) else {}
DMUON = {"lr": 0.02, "adamw_lr": 3e-3, "ns_compute_dtype": "float32", **CHECK}
ADAMW_LR = 3e-3


def dataset(n: int = 128) -> TensorDataset:
    """A fixed regression problem (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g) / 4)
    return TensorDataset(x, y)


class RankBatches(Sampler):
    """Global batch ``b`` is rows ``2·PER_RANK·b`` to ``2·PER_RANK·(b+1)``; rank ``r`` of
    ``WORLD`` takes its ``r``-th half (``rank=None``: the whole global batch)."""

    def __init__(self, n: int, rank: int | None) -> None:
        self.n, self.rank = n, rank

    def __iter__(self):
        for b in range(len(self)):
            rows = list(range(WORLD * PER_RANK * b, WORLD * PER_RANK * (b + 1)))
            yield rows if self.rank is None else rows[PER_RANK * self.rank :][:PER_RANK]

    def __len__(self) -> int:
        return self.n // (WORLD * PER_RANK)


def split(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The matrices (DMuon) and the biases (AdamW)."""
    params = list(module.parameters())
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]


class TwoOptimizers(L.LightningModule):
    """Manual optimization: AdamW over the biases stepped before DMuon over the matrices."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every process
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
        )
        self.automatic_optimization = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        for opt in self.optimizers():
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
        for opt in self.optimizers():
            opt.zero_grad()
        return loss

    def configure_optimizers(self):
        matrices, biases = split(self)
        strategy = self.trainer.strategy
        return [
            torch.optim.AdamW(biases, lr=ADAMW_LR),
            DMuon([{"params": matrices}], distributed=strategy.dedication, **DMUON),
        ]


class AdamWOnly(TwoOptimizers):
    """No DMuon under DMuonStrategy's owner mode (automatic optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=ADAMW_LR)


class RootWeights(L.LightningModule):
    """A weight matrix held by the LightningModule itself (its layer ``w``, last in the
    layers' order), and a ``training_step`` that never calls the module: the trainer runs
    no forward pre-hook of the LightningModule, so ``DMuonStrategy`` waits for ``w`` itself.
    Every layer alone (``layer_pack_mb=0``: no packed layer's hook waits for it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
        )
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(torch.tanh(x @ self.w)), y)

    def configure_optimizers(self):
        return DMuon(param_groups(self), distributed=self.trainer.strategy.dedication, **DMUON)


class SomeRanksOnly(L.LightningModule):
    """A layer (``extra``) that the second step runs on rank 0 only, in a ``training_step``
    that never calls the LightningModule's forward, under ``reshard_after_forward=True``
    (ZeRO-3-like)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.b = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.a(x))
        if batch_idx == 1 and self.global_rank == 0:
            h = h + torch.tanh(self.extra(h))
        return nn.functional.mse_loss(self.b(h), y)

    def configure_optimizers(self):
        strategy = self.trainer.strategy
        return DMuon(param_groups(self), distributed=strategy.dedication, timeout=30, **DMUON)


CASES = {
    "two_optimizers": TwoOptimizers,
    "adamw_only": AdamWOnly,
    "root_weights": RootWeights,
    "some_ranks_only": SomeRanksOnly,
}
DEDICATE = {
    "root_weights": {"layer_pack_mb": 0},
    "some_ranks_only": {"reshard_after_forward": True},
}


def main() -> None:
    from dmuon.integrations.lightning import DMuonStrategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", choices=sorted(CASES), required=True)
    parser.add_argument("--out", required=True, help="save each rank's result here")
    args = parser.parse_args()

    for case in args.case:  # one launch, one process group, one Trainer after another
        model = CASES[case]()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=DMuonStrategy(dedicate_options=DEDICATE.get(case)),
            max_epochs=1,
            use_distributed_sampler=False,  # RankBatches gives each rank its half
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
        )
        data = dataset()
        loader = DataLoader(data, batch_sampler=RankBatches(len(data), trainer.global_rank))
        result: dict[str, object]
        try:
            trainer.fit(model, loader)  # on an error, Lightning tears down, then re-raises
        except Exception as exc:  # the case's expected refusal: recorded, the next case runs
            result = {"error": f"{type(exc).__module__}.{type(exc).__name__}: {exc}"}
        else:
            result = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        torch.save(result, f"{args.out}.{case}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
