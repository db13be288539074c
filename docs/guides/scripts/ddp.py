"""Train a small language model with DMuon in place of DDP (owner mode).

Run on 2 processes (CPU: gloo; GPUs: NCCL, one per process)::

    torchrun --nproc-per-node 2 docs/guides/scripts/ddp.py

The DMuon lines are marked ``# DMuon``; the DDP + AdamW version of this script
wraps the model in ``DistributedDataParallel`` and builds ``torch.optim.AdamW``.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dmuon.integrations.ddp import dedicate
from dmuon.optim import DMuon, param_groups

# The model and the batches, shared by the guides' scripts, live next to this file.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from guide_model import Model, batch


def train(steps: int = 50) -> dict[str, torch.Tensor]:
    if not dist.is_initialized():
        dist.init_process_group()  # torchrun's environment; with CUDA: "cpu:gloo,cuda:nccl"
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = "nccl" in dist.get_backend_config()  # not get_backend(): "undefined" for that default
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = Model().to(device)
    ded = dedicate(model)  # DMuon: replaces DistributedDataParallel(model)
    # fp32 Newton–Schulz on a CPU (bf16 matmul is slow without AVX-512-BF16/AMX)
    extra = {} if cuda else {"ns_compute_dtype": "float32"}
    opt = DMuon(param_groups(model), lr=2e-2, adamw_lr=3e-3, distributed=ded, **extra)  # DMuon

    for step in range(steps):
        x, y = batch(step, rank, world, device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    ded.wait()  # the owners' last broadcasts, before reading the weights
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


if __name__ == "__main__":
    train()
    dist.destroy_process_group()
