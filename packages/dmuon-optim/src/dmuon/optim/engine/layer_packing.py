"""The packing rule of owner mode's layers, written once for the engine and the planner.

Owner mode reduces, steps and publishes a model layer by layer; layers too small to
pay for a collective of their own are packed with their neighbours first, as DDP
packs gradients into buckets (``benchmarks/step_overhead.py``: on a model of many
small layers the per-collective latency, not the bytes, bounds the step). The rule
is greedy in natural (forward) order: a pack takes the next layer while its bytes
stay within the limit and the layer is on the pack's device; a layer larger than
the limit is a pack of its own.

:func:`pack_runs` is that rule on plain ``(key, bytes, device)`` entries, with no
parameter or record in sight, so that the engine
(:func:`~dmuon.optim.engine.layer_record.pack_layers`, on its records) and the
planner (:mod:`dmuon.optim.planner.traffic`, on the owner plan's items) cut the same
units, and price and make the same collectives.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import TypeVar

__all__ = ["DEFAULT_PACK_MB", "check_pack_mb", "pack_runs"]

DEFAULT_PACK_MB = 1.0
"""Default size limit of a pack of consecutive layers (:func:`pack_runs`), MiB:
PyTorch DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""

K = TypeVar("K")


def check_pack_mb(layer_pack_mb: object) -> int:
    """``layer_pack_mb`` (MiB, a number ``>= 0``) in bytes, the limit :func:`pack_runs` takes.

    Raises:
        ValueError: not a number, or negative (``0`` packs nothing).

    Examples:
        >>> check_pack_mb(1.0), check_pack_mb(0)
        (1048576, 0)
    """
    if (
        isinstance(layer_pack_mb, bool)
        or not isinstance(layer_pack_mb, int | float)
        or not layer_pack_mb >= 0
    ):
        raise ValueError(
            f"layer_pack_mb must be a number of MiB >= 0 (0: every layer on its own), got "
            f"{layer_pack_mb!r}"
        )
    return int(min(layer_pack_mb * 2**20, sys.maxsize))


def pack_runs(layers: Sequence[tuple[K, int, Hashable]], max_bytes: int) -> list[list[K]]:
    """Cut ``layers`` (in natural order) into runs of consecutive layers, greedily.

    A run takes the next layer while the run's bytes stay within ``max_bytes`` and the
    layer's device is the run's (a run's buffers live on one device); otherwise the
    layer starts a new run. A layer of more than ``max_bytes`` is a run of its own.

    Args:
        layers: ``(key, nbytes, device)`` of each layer in natural (forward) order:
            ``nbytes`` every byte the layer's unit carries (each rank's local part),
            ``device`` anything comparable (``None`` where there is one device).
        max_bytes: the limit; ``0``: every layer a run of its own (nothing packed).

    Returns:
        The keys of each run, in order; every key once.

    Raises:
        ValueError: a negative ``max_bytes`` or ``nbytes``.

    Examples:
        >>> pack_runs([("b.0", 16, None), ("b.1", 16, None), ("b.2", 16, None)], 32)
        [['b.0', 'b.1'], ['b.2']]
        >>> pack_runs([("b.0", 8, "cuda:0"), ("b.1", 8, "cuda:1")], 32)  # never across devices
        [['b.0'], ['b.1']]
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 (0: no packing), got {max_bytes}")
    runs: list[list[K]] = []
    size = 0
    device: Hashable = None
    for key, nbytes, here in layers:
        if nbytes < 0:
            raise ValueError(f"layer {key!r}: nbytes must be >= 0, got {nbytes}")
        if runs and max_bytes and size + nbytes <= max_bytes and here == device:
            runs[-1].append(key)
            size += nbytes
        else:
            runs.append([key])
            size, device = nbytes, here
    return runs
