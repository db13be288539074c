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
from hf_trainer import main  # examples/ is on the path (test_hf_trainer.py)
from safetensors.torch import load_file

from dmuon.integrations.hf import missing_state


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(checkpoint, "model.safetensors"))


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
