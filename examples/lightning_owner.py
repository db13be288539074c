"""DMuon's owner mode under Lightning: ``DMuonStrategy`` dedicates the model instead of DDP.

    python examples/lightning_owner.py --devices 2                      # CPU, 2 processes
    python examples/lightning_owner.py --devices 2 --accumulate 2       # gradient accumulation
    python examples/lightning_owner.py --devices 2 --ckpt-dir ckpts     # a checkpoint per epoch
    python examples/lightning_owner.py --devices 2 --resume ckpts/epoch=0-step=8.ckpt
    python examples/lightning_owner.py --devices 2 --mode replicated   # keep the DDP wrapper
    python examples/lightning_owner.py --devices 2 --clip-val 0.2      # gradient clipping
    python examples/lightning_owner.py --devices 2 --precision 16-mixed  # fp16 loss scaling

Each matrix's gradient is reduced to its owner rank only (no DDP all-reduce), the
owner orthogonalises it and broadcasts the new weight. Lightning's gradient clipping
clips the averaged gradients (DMuon's clip_grad_norm_ / clip_grad_value_, called by the
strategy's precision plugin); with fp16 loss scaling every rank skips a step that
overflowed on any rank (the strategy's ShardedGradScaler). Checkpoints hold every owner's
momentum and resume exactly. With ``--out PREFIX`` every rank saves its final
parameters and its reduction counts to ``PREFIX.rank<N>.pt`` (the tests read them).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dmuon.comm import CommStats
from dmuon.integrations.lightning import DMuonStrategy, dmuon_optimizer


def dataset(n: int = 256) -> TensorDataset:
    """A fixed regression problem (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g) / 4)
    return TensorDataset(x, y)


def warmdown(step: int) -> float:
    """The learning-rate factor after ``step`` optimizer steps."""
    return 1.0 / (1.0 + 0.1 * step)


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
        # Owner mode under DMuonStrategy, replicated under strategy="ddp", single mode
        # in one process: dmuon_optimizer reads the mode off the Trainer.
        opt = dmuon_optimizer(
            self,
            lr=self.hparams.lr,
            adamw_lr=self.hparams.adamw_lr,
            ns_compute_dtype="float32",  # fp32 Newton–Schulz: comparable across runs to 1e-5
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmdown)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class OwnerLog(L.Callback):
    """The matrices this rank owns, and after every backward how many owner reductions
    it has issued so far."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats
        self.owned: tuple[str, ...] = ()
        self.calls: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        ded = trainer.strategy.dedication  # None in replicated mode
        self.owned = ded.owned if ded is not None else ()

    def on_after_backward(self, trainer, pl_module) -> None:
        self.calls.append(self.stats["reduce_to_owners"].calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--mode", choices=("owner", "replicated"), default="owner", help="DMuonStrategy's mode"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--samples", type=int, default=256, help="size of the data set")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--ckpt-dir", default=None, help="save a checkpoint after every epoch")
    parser.add_argument("--resume", default=None, help="resume from this checkpoint")
    parser.add_argument("--out", default=None, help="save each rank's final parameters here")
    parser.add_argument("--clip-val", type=float, default=None, help="gradient_clip_val")
    parser.add_argument("--clip-algorithm", choices=("norm", "value"), default="norm")
    parser.add_argument(
        "--precision", choices=("32-true", "bf16-mixed", "16-mixed"), default="32-true"
    )
    parser.add_argument(
        "--init-scale", type=float, default=2.0**16, help="16-mixed: the loss scale to start from"
    )
    args = parser.parse_args()

    stats = CommStats()  # the bytes this rank's owner collectives move
    log = OwnerLog(stats)
    callbacks: list[L.Callback] = [log]
    if args.ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(args.ckpt_dir, save_top_k=-1))
    model = Regressor()
    # Lightning gives each rank a DistributedSampler (shuffled with seed PL_GLOBAL_SEED,
    # default 0, and the epoch), whatever the DataLoader says.
    loader = DataLoader(dataset(args.samples), batch_size=args.batch_size, shuffle=False)
    if args.mode == "owner":
        strategy = DMuonStrategy(dedicate_options={"stats": stats})
    else:  # Lightning's DDP wrapper, DMuon in replicated mode; checkpoints still whole
        strategy = DMuonStrategy("replicated")
    precision: dict = {"precision": args.precision}
    if args.precision == "16-mixed":
        # On CPU Lightning turns precision="16-mixed" into bf16; the plugin keeps fp16.
        # (On GPUs pass precision="16-mixed".) DMuonStrategy makes the scaler a
        # ShardedGradScaler with these settings.
        scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        **precision,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip_val,  # by DMuon's clip_grad_norm_ or clip_grad_value_
        gradient_clip_algorithm=args.clip_algorithm,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader, ckpt_path=args.resume)
    opt = trainer.optimizers[0]
    loss = float(trainer.logged_metrics["loss"])
    sent = stats.total_bytes_sent / 2**10
    print(
        f"rank {trainer.global_rank}: DMuon mode {opt.mode}, loss {loss:.5f}, "
        f"{trainer.global_step} steps, owns {list(log.owned)}, "
        f"{sent:.1f} KiB sent by owner collectives"
    )
    if args.out:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        torch.save(
            {
                "params": params,
                "owned": log.owned,
                "reductions": log.calls,
                "mode": opt.mode,
                "loss_scale": scaler.get_scale() if scaler is not None else None,
                "skipped_steps": opt.skipped_steps,
            },
            f"{args.out}.rank{trainer.global_rank}.pt",
        )


if __name__ == "__main__":
    main()
