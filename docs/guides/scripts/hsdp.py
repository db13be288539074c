"""Train a small language model with HSDP (FSDP2 on a 2-D mesh) and DMuon.

Run on 4 processes as 2 replicas × 2 shards (CPU: gloo; GPUs: NCCL)::

    torchrun --nproc-per-node 4 docs/guides/scripts/hsdp.py

The DMuon lines are marked ``# DMuon``; the AdamW version of this script calls
``fully_shard`` without ``ignored_params`` and builds ``torch.optim.AdamW``.
Owners are planned over all 4 ranks; a gradient is reduced within the shard
group, then across replicas, to its owner, and the owner's new weight travels
back the same way, waited on only in the next forward.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon.integrations.fsdp import dedicate
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
    replicas = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh(
        device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )

    model = Model().to(device)
    ded = dedicate(model, mesh)  # DMuon: every matrix gets one owner rank
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)  # DMuon: ignored_params
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
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
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for n, p in model.named_parameters()
    }


if __name__ == "__main__":
    train()
    dist.destroy_process_group()
