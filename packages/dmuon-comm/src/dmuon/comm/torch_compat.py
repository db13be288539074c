"""torch.distributed names that changed inside the torch range DMuon supports (2.11+).

Every collective DMuon calls whose name differs across that range goes through this
module, one entry per name, each with the release that introduced the new name. The
new name is used where it exists (the old one warns as deprecated there); the old
one otherwise. ``nox -s compat`` runs the test suites on the oldest supported torch,
so both branches of each entry are exercised in CI (the newest on the pinned torch).

dmuon-optim imports these collectives from here too, so the choice is made in one
place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TORCH_VERSION", "all_gather_single", "reduce_scatter_single", "uses_new_names"]


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _release(torch.__version__)
"""The running torch's ``(major, minor)``, e.g. ``(2, 11)`` for ``2.11.0+cu130``."""

# torch 2.13 renamed the single-tensor collectives:
#   all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor -> reduce_scatter_single
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None)  # torch >= 2.13
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None)  # torch >= 2.13


def uses_new_names() -> bool:
    """Whether this torch has the 2.13 names (``all_gather_single``, ``reduce_scatter_single``).

    Example:
        >>> isinstance(uses_new_names(), bool)
        True
    """
    return _ALL_GATHER_SINGLE is not None and _REDUCE_SCATTER_SINGLE is not None


def all_gather_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Gather ``input`` of every rank into ``output`` (world × input, rank order).

    ``torch.distributed.all_gather_single`` from torch 2.13, ``all_gather_into_tensor``
    before it: same arguments, same result, same work handle when ``async_op``.

    Example:
        >>> callable(all_gather_single)
        True
    """
    if _ALL_GATHER_SINGLE is not None:
        return _ALL_GATHER_SINGLE(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``input`` (world × output) over ranks, each keeping its slice in ``output``.

    ``torch.distributed.reduce_scatter_single`` from torch 2.13, ``reduce_scatter_tensor``
    before it.

    Example:
        >>> callable(reduce_scatter_single)
        True
    """
    if _REDUCE_SCATTER_SINGLE is not None:
        return _REDUCE_SCATTER_SINGLE(output, input, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
