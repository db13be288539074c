"""Train a tiny Llama with DMuon from the Hugging Face Trainer.

One process:            python examples/hf_trainer.py --output-dir out
Two ranks (CPU, gloo):  python -m torch.distributed.run --nproc_per_node 2 \
                            examples/hf_trainer.py --output-dir out
Resume:                 add --resume out/checkpoint-3
Stock Trainer:          add --stock-trainer (DMuon through optimizer_cls_and_kwargs)

The model is built from a LlamaConfig (nothing is downloaded); the data are
token sequences that count up with a per-sequence stride, which a two-layer model
learns in a few steps. The losses go to <output-dir>/losses.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from dmuon.integrations.hf import DMuonTrainer, optimizer_cls_and_kwargs, unwrap_optimizer

VOCAB = 128
DMUON_OPTIONS = {"momentum": 0.95, "ns_steps": 5}  # anything DMuon takes: rule=, ...


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A two-layer Llama (about 50k parameters), the same on every rank."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


class CountingData(torch.utils.data.Dataset):
    """Sequences ``(a + b·t) mod VOCAB``: next-token prediction a small model can learn."""

    def __init__(self, n: int = 256, length: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(length)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def build_trainer(opts: argparse.Namespace) -> Trainer:
    """The Trainer of this run: DMuonTrainer, or a stock Trainer with DMuon's factory."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=opts.grad_accum,
        learning_rate=opts.lr,  # DMuon's matrix lr and the AdamW lr of the rest
        weight_decay=0.01,
        adam_beta1=0.9,  # AdamW (embeddings, head, norms) takes Trainer's betas and eps
        adam_beta2=0.95,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=opts.save_steps,
        seed=0,
        use_cpu=True,
        ddp_backend="gloo" if distributed else None,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        report_to=[],
        disable_tqdm=True,
    )
    model, data = tiny_llama(), CountingData()
    if opts.stock_trainer:
        # A stock Trainer: fine on one process. Under torchrun it writes optimizer.pt
        # from rank 0 only, without the other owners' momentum: use DMuonTrainer there.
        factory = optimizer_cls_and_kwargs(args, **DMUON_OPTIONS)
        return Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=factory)
    return DMuonTrainer(model=model, args=args, train_dataset=data, dmuon_options=DMUON_OPTIONS)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Train (or resume); returns the loss of every optimizer step and DMuon's mode."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--resume", default=None, help="a checkpoint directory")
    parser.add_argument("--stock-trainer", action="store_true")
    opts = parser.parse_args(argv)

    trainer = build_trainer(opts)
    trainer.train(resume_from_checkpoint=opts.resume)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"losses": losses, "mode": unwrap_optimizer(trainer.optimizer).mode}
    if trainer.is_world_process_zero():
        with open(os.path.join(opts.output_dir, "losses.json"), "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
