"""The device of the small tensors DMuon builds on the host to send over a group.

Flags, counts and digests (a step's agreement, gradient presence, plan checks) are
made on the host. gloo takes them there, and so does torch's default process group
with CUDA (``"cpu:gloo,cuda:nccl"``); a group with NCCL alone
(``init_process_group("nccl")``) has no CPU collectives, so they travel on the GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["flag_device"]


def flag_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor made on the host (flags, counts, digests) must live to be
    sent over ``group``.

    The CPU where the group's backend takes CPU tensors (gloo; torch's default process
    group with CUDA, ``"cpu:gloo,cuda:nccl"``); the current CUDA device where it is NCCL
    alone (``init_process_group("nccl")``), which has no CPU collectives. Reading such a
    tensor back (``.tolist()``) then waits for the device.

    Examples:
        >>> flag_device(None)  # no process group: the host
        device(type='cpu')
    """
    if not dist.is_available() or not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    # "nccl", or a device map without a CPU entry ("cuda:nccl")
    devices = {entry.split(":")[0] for entry in backend.split(",") if ":" in entry}
    if backend == "nccl" or (devices and "cpu" not in devices and "cuda" in devices):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
