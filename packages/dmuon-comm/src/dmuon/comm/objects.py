"""Gathering small Python objects (error messages, plan descriptions) from every rank.

``torch.distributed.all_gather_object`` turns its byte tensors back into bytes with
``Tensor.numpy()``, so it fails with "Numpy is not available" where numpy is not
installed — and numpy is not a dependency of torch or of DMuon. This is the same
collective on plain ``uint8`` tensors: pickle, all-gather the lengths, all-gather
the payloads padded to the longest (gloo has no uneven all-gather), unpickle.
Meant for the rare, small messages of error paths, not for tensors.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.flags import flag_device
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["all_gather_objects"]


_WHAT = "all-gather of picklable objects"


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order of ``group`` (picklable objects only).

    Every rank of ``group`` must call it. Without a process group (or with a group
    of one rank) it returns ``[obj]``. Its waits run under the current
    :func:`~dmuon.comm.collective_timeout`.

    Examples:
        >>> all_gather_objects({"rank": 0, "text": "fine"})  # one process
        [{'rank': 0, 'text': 'fine'}]
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    device = flag_device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    n = dist.get_world_size(group)
    sizes = torch.empty(n, dtype=torch.int64, device=device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    wait_work(all_gather_single(sizes, mine, group=group, async_op=True), _WHAT, group)
    lengths = sizes.tolist()
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    everyone = torch.empty(n * longest, dtype=torch.uint8, device=device)
    wait_work(all_gather_single(everyone, padded, group=group, async_op=True), _WHAT, group)
    rows = everyone.view(n, longest).cpu()
    return [pickle.loads(bytes(rows[r, : lengths[r]].tolist())) for r in range(n)]
