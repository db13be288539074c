"""The opening every plan-wide collective shares: check, count, then the items per dtype.

:func:`~dmuon.comm.all_gather_updates`, :func:`~dmuon.comm.shard_all_to_all` and
:func:`~dmuon.comm.shard_all_to_all_reverse` move every item of an
:class:`~dmuon.comm.OwnerPlan` in one collective per dtype. Each checks its
inputs (on every rank at once with ``verify=True``, so a bad input raises
everywhere instead of leaving the other ranks waiting), counts the call, and
then groups the plan's items by dtype and by rank; only the volume and the
packing of the send buffer differ between them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from dmuon.comm.items import MatrixItem
from dmuon.comm.owner_plan import OwnerPlan
from dmuon.comm.process_groups import agree, fingerprint
from dmuon.comm.stats import CommStats, default_stats

__all__ = ["begin", "buffer_device", "check_owned", "items_by_dtype"]


def begin(
    name: str,
    plan: OwnerPlan,
    group: dist.ProcessGroup | None,
    check: Callable[[], tuple[int, int]],
    *,
    verify: bool,
    stats: CommStats | None,
) -> tuple[int, int, CommStats]:
    """Run ``check`` (agreed over ``group`` when ``verify``), count one call of ``name``.

    Returns:
        ``(n, me, stats)``: what ``check`` returned (the group's size and this
        rank's index in it) and the stats the call records into (``stats`` or
        :func:`~dmuon.comm.default_stats`).
    """
    stats = stats if stats is not None else default_stats()
    if verify:
        n, me = agree(name, [group], check, fingerprint(name, plan.digest()))
    else:
        n, me = check()
    stats.count_call(name)
    return n, me, stats


def buffer_device(
    device: torch.device | str | None, *given: Mapping[str, torch.Tensor] | None
) -> torch.device | None:
    """Where a plan-wide collective's buffers live: ``device`` when given, else the
    device of the first tensor among ``given`` (the caller's inputs, then its ``out``),
    else ``None`` (torch's default device).

    A rank that owns nothing of a layer hands in no update: its buffers must still be on
    the device of every other rank's (under NCCL, the GPU), so the engines pass the
    parameters' device.

    Examples:
        >>> import torch
        >>> buffer_device(None, {}, {"a": torch.zeros(1)})
        device(type='cpu')
        >>> buffer_device("meta", {}) == torch.device("meta")
        True
    """
    if device is not None:
        return torch.device(device)
    for tensors in given:
        for t in (tensors or {}).values():
            return t.device
    return None


def items_by_dtype(plan: OwnerPlan, n: int) -> Iterator[tuple[torch.dtype, list[list[MatrixItem]]]]:
    """Per dtype of the plan's items (first-seen order), each of the ``n`` ranks' items of it."""
    for dtype in dict.fromkeys(i.dtype for i in plan.items):
        yield dtype, [[i for i in plan.items_of(r) if i.dtype == dtype] for r in range(n)]


def check_owned(
    name: str,
    plan: OwnerPlan,
    me: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    noun: str,
    missing: str,
) -> None:
    """Raise unless ``tensors`` holds every item rank ``me`` owns, in its shape and dtype.

    The messages read ``"<name>: rank <me> owns '<item>' but <missing>"`` and
    ``"<name>: <noun> of '<item>' must be <dtype> of shape <shape>, got ..."``.
    """
    for item in plan.items_of(me):
        if item.name not in tensors:
            raise ValueError(f"{name}: rank {me} owns {item.name!r} but {missing}")
        t = tensors[item.name]
        if tuple(t.shape) != item.shape or t.dtype != item.dtype:
            raise ValueError(
                f"{name}: {noun} of {item.name!r} must be {item.dtype} of shape "
                f"{item.shape}, got {t.dtype} of shape {tuple(t.shape)}"
            )
