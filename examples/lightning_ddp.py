"""DMuon in a LightningModule's ``configure_optimizers``, under Lightning's DDP strategy.

    python examples/lightning_ddp.py --devices 2          # CPU, 2 processes, gloo
    python examples/lightning_ddp.py --devices 1          # one process

Lightning wraps the model in DistributedDataParallel, which averages the gradients,
so DMuon runs in ``mode="replicated"``: each matrix is orthogonalised by one owner
rank and the new weights are all-gathered. With ``--out PREFIX`` every rank saves its
final parameters to ``PREFIX.rank<N>.pt`` (the tests compare them with one process).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dmuon.optim import DMuon, param_groups


def dataset(n: int = 256) -> TensorDataset:
    """A fixed regression problem (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g) / 4)
    return TensorDataset(x, y)


class Regressor(L.LightningModule):
    """A small MLP: its hidden matrices take Muon, biases and the head AdamW."""

    def __init__(self, lr: float = 0.02, adamw_lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)  # the same initial weights in every process
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # Under DDP the gradients arrive averaged: mode="replicated". In one process
        # there is no process group and DMuon runs in "single" mode.
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return DMuon(
            param_groups(self),
            lr=self.hparams.lr,
            adamw_lr=self.hparams.adamw_lr,
            mode="replicated" if distributed else None,
            ns_compute_dtype="float32",  # fp32 Newton–Schulz: comparable across runs to 1e-5
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="save each rank's final parameters here")
    args = parser.parse_args()

    model = Regressor()
    # Under DDP, Lightning gives each rank a DistributedSampler over the training set; it
    # shuffles (seed PL_GLOBAL_SEED, default 0), whatever the DataLoader says.
    loader = DataLoader(dataset(), batch_size=args.batch_size, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader)
    opt = trainer.optimizers[0]
    loss = float(trainer.logged_metrics["loss"])
    print(f"rank {trainer.global_rank}: DMuon mode {opt.mode}, loss {loss:.5f}")
    if args.out:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(params, f"{args.out}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
