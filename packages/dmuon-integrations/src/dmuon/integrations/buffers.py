"""Module buffers kept equal across ranks, as DDP keeps them: rank 0's, before each forward.

A buffer is state that is not trained by the optimizer — BatchNorm's running
mean and variance, its batch counter. Each rank updates its copy from its own
batch, so the copies drift apart. Stock DDP (``broadcast_buffers=True``, its
default) broadcasts rank 0's buffers at the start of every forward it runs with
gradients enabled; :func:`install_buffer_broadcast` does the same for a model
dedicated with :func:`dmuon.integrations.ddp.dedicate`, one broadcast per buffer
dtype, under DMuon's ``timeout=`` (a rank that does not join raises
:class:`dmuon.comm.CollectiveError` naming it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import collective_timeout, wait_work

__all__ = ["broadcast_buffers", "install_buffer_broadcast"]


@torch.no_grad()
def broadcast_buffers(module: nn.Module, group: Any = None) -> int:
    """Copy group rank 0's buffers of ``module`` to every rank; returns the number copied.

    One broadcast per dtype, of the buffers flattened into one tensor.

    Examples:
        >>> bn = torch.nn.BatchNorm1d(4)
        >>> broadcast_buffers(bn)  # one process: nothing to copy
        0
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buf in module.buffers():
        by_dtype.setdefault(buf.dtype, []).append(buf)
    for bufs in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in bufs])
        work = dist.broadcast(flat, group_src=0, group=group, async_op=True)
        # the forward's kernels read the buffers next: on NCCL the stream waits
        wait_work(work, "broadcast of module buffers from rank 0", group, device=flat.device)
        offset = 0
        for b in bufs:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
    return sum(len(b) for b in by_dtype.values())


def install_buffer_broadcast(
    model: nn.Module, group: Any, timeout: Callable[[], float | None]
) -> RemovableHandle | None:
    """Before every forward of ``model`` with gradients enabled, copy rank 0's buffers.

    Args:
        model: the dedicated model.
        group: its process group.
        timeout: returns the deadline of the broadcast (DMuon's ``timeout=``).

    Returns:
        The forward pre-hook's handle, or ``None`` when ``model`` has no buffers.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        >>> handle = install_buffer_broadcast(model, None, lambda: 30.0)
        >>> _ = model(torch.randn(3, 4))  # one process: the hook has nothing to copy
        >>> handle.remove()
        >>> install_buffer_broadcast(torch.nn.Linear(4, 2), None, lambda: 30.0) is None
        True
    """
    if next(model.buffers(), None) is None:
        return None

    def hook(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # DDP: training forwards; not under no_grad/eval
            with collective_timeout(timeout()):
                broadcast_buffers(module, group)

    return model.register_forward_pre_hook(hook)
