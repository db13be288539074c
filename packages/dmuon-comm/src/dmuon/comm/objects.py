"""Gathering small Python objects (error messages, plan descriptions) from every rank,
or sending one rank's to the others.

``torch.distributed.all_gather_object`` turns its byte tensors back into bytes with
``Tensor.numpy()``, so it fails with "Numpy is not available" where numpy is not
installed — and numpy is not a dependency of torch or of DMuon. This is the same
collective on plain ``uint8`` tensors: pickle, all-gather the lengths, all-gather
the payloads padded to the longest (gloo has no uneven all-gather), unpickle; and
:func:`broadcast_object` the same way with one sender (``broadcast_object_list`` has
the same numpy dependency). Meant for the rare, small messages of error paths and of
construction, not for tensors.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.flags import flag_device
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["all_gather_objects", "broadcast_object", "broadcast_payload"]


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


def broadcast_payload(
    data: bytes, group: dist.ProcessGroup | None = None, what: str = "broadcast of a payload"
) -> torch.Tensor:
    """Rank 0 of ``group``'s ``data`` (the group's first rank; the others' is ignored) on
    every rank, as a CPU ``uint8`` tensor: two broadcasts from that rank, the length and
    then the bytes, under the current :func:`~dmuon.comm.collective_timeout`. Every rank
    of ``group`` must call it, in a process group of more than one rank. The caller turns
    the tensor into bytes as it can (``bytes(t.tolist())`` without numpy,
    ``t.numpy().tobytes()`` with it, faster for a large payload).
    """
    device = flag_device(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    wait_work(dist.broadcast(length, src=src, group=group, async_op=True), what, group)
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if dist.get_rank() == src
        else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    )
    wait_work(dist.broadcast(payload, src=src, group=group, async_op=True), what, group)
    return payload.cpu()


def broadcast_object(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """The ``obj`` of rank 0 of ``group`` (the group's first rank), on every rank.

    Every rank of ``group`` must call it; the others' ``obj`` is ignored. Two broadcasts
    from that rank, the payload's length and then the pickled payload, under the current
    :func:`~dmuon.comm.collective_timeout`. Without a process group (or with a group of
    one rank) it returns ``obj``.

    Examples:
        >>> broadcast_object({"owners": [0, 1]})  # one process
        {'owners': [0, 1]}
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return obj
    first = dist.get_rank() == (dist.get_global_rank(group, 0) if group is not None else 0)
    payload = broadcast_payload(
        pickle.dumps(obj) if first else b"", group, "broadcast of a picklable object"
    )
    return obj if first else pickle.loads(bytes(payload.tolist()))
