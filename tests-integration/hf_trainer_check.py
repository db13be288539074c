"""Driver of test_hf_trainer.py: runs the guide's script (examples/hf_trainer.py) in
several configurations in one process — transformers is imported once — and writes
``result-<rank>.json`` with what the test checks.

    python hf_trainer_check.py OUT                                   # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 hf_trainer_check.py OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch
from hf_trainer import CountingData, main, tiny_llama  # examples/ is on the path
from safetensors.torch import load_file, save_file
from transformers import TrainingArguments

from dmuon.integrations.hf import DMuonTrainer, missing_state, unwrap_optimizer


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(checkpoint, "model.safetensors"))


def same_global_batch(out: str, world: int) -> dict[str, object]:
    """Three steps of 8 sequences in order (no shuffle): one process takes 4 per
    micro-batch, each of two ranks 2; two micro-batches per step; clipping at 0.05 (below
    the gradient norm of ~0.9, so every step clips). Writes the final weights."""
    args = TrainingArguments(
        output_dir=f"{out}/global", max_steps=3, per_device_train_batch_size=4 // world,
        gradient_accumulation_steps=2, train_sampling_strategy="sequential", max_grad_norm=0.05,
        learning_rate=1e-2, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=1,
        logging_steps=1, save_strategy="no", seed=0, use_cpu=True,
        ddp_backend="gloo" if world > 1 else None, ddp_find_unused_parameters=False,
        report_to=[], disable_tqdm=True,
    )  # fmt: skip
    # check_every=1: the ranks' parameters compared after every step (no false alarm)
    options = {"ns_compute_dtype": "float32", "check_every": 1}
    trainer = DMuonTrainer(model=tiny_llama(), args=args, train_dataset=CountingData(n=32),
                           dmuon_options=options)  # fmt: skip
    trainer.train()
    weights = f"{out}/global-weights.safetensors"
    if trainer.is_world_process_zero():
        save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, weights)
    log = trainer.state.log_history
    return {
        "weights": weights,
        "steps": unwrap_optimizer(trainer.optimizer).steps_taken,
        "grad_norms": [e["grad_norm"] for e in log if "grad_norm" in e],
    }


def run(out: str) -> dict[str, object]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result: dict[str, object] = {"rank": rank, "world_size": world}
    # 1. DMuonTrainer, six steps (two micro-batches each), checkpoints at 3 and 6.
    full = main(["--output-dir", f"{out}/full"])
    result["full"], result["mode"] = full["losses"], full["mode"]
    # 2. A fresh model and trainer resumed from checkpoint-3 of run 1.
    result["resumed"] = main(
        ["--output-dir", f"{out}/resumed", "--resume", f"{out}/full/checkpoint-3"]
    )["losses"]
    a, b = _weights(f"{out}/full/checkpoint-6"), _weights(f"{out}/resumed/checkpoint-6")
    result["weights_max_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
    sd = torch.load(f"{out}/full/checkpoint-3/optimizer.pt", weights_only=True)
    result["full_missing"] = missing_state(sd)
    owners = sd["distributed"].get("owners", {})
    norms = {}
    for g in sd["param_groups"]:
        for idx, name in zip(g["params"], g.get("param_names", []), strict=True):
            if name in owners:
                norms[name] = float(sd["state"][idx]["momentum_buffer"].norm())
    result["owners"] = owners
    result["momentum_norms"] = norms
    # 3. A stock Trainer with DMuon's optimizer factory, three steps.
    stock = main(["--output-dir", f"{out}/stock", "--stock-trainer", "--max-steps", "3"])
    result["stock"] = stock["losses"]
    stock_sd = torch.load(f"{out}/stock/checkpoint-3/optimizer.pt", weights_only=True)
    result["stock_missing"] = missing_state(stock_sd)
    # 5. The same global batch on either launch (see same_global_batch).
    result["global"] = same_global_batch(out, world)
    if world > 1:
        # 4. The stock checkpoint lacks rank 1's momentum: DMuonTrainer refuses it.
        try:
            main(["--output-dir", f"{out}/refused", "--resume", f"{out}/stock/checkpoint-3"])
            result["refused"] = None
        except ValueError as e:
            result["refused"] = str(e)
    return result


if __name__ == "__main__":
    out = sys.argv[1]
    result = run(out)
    with open(os.path.join(out, f"result-{result['rank']}.json"), "w") as f:
        json.dump(result, f)
