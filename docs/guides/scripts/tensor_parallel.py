"""Train a small language model with tensor parallelism and DMuon, never gathering a matrix.

Run on 2 processes, each holding half of every block's MLP (CPU: gloo; GPUs: NCCL)::

    torchrun --nproc-per-node 2 docs/guides/scripts/tensor_parallel.py

``parallelize_module`` splits each block's ``fc`` by rows (``ColwiseParallel``:
``Shard(0)``) and ``proj`` by columns (``RowwiseParallel``: ``Shard(1)``) over a
``tp`` mesh of all ranks. Every rank sees the whole batch. DMuon in ``single``
mode steps each split matrix on its shards: momentum on the shard, the polar
factor by the tensor-parallel Gram Newton–Schulz (an all-reduce of the small Gram
matrix over ``tp`` at the start and at each restart, no gather), the update into
the shard. The DMuon lines are marked ``# DMuon``.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))

    model = Model().to(device)
    for block in model.blocks:
        parallelize_module(block, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    # fp32 Newton–Schulz on a CPU (bf16 matmul is slow without AVX-512-BF16/AMX)
    extra = {} if cuda else {"ns_compute_dtype": "float32"}
    # DMuon: mode="single" steps the tensor-parallel matrices on their shards
    opt = DMuon(param_groups(model), lr=2e-2, adamw_lr=3e-3, mode="single", **extra)

    for step in range(steps):
        x, y = batch(step, 0, 1, device)  # the whole global batch on every TP rank
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for n, p in model.named_parameters()
    }


if __name__ == "__main__":
    train()
    dist.destroy_process_group()
