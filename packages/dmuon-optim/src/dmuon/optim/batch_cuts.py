"""How a bucket is cut into batched rule calls: at most so many matrix entries a call.

:func:`default_batch_elements` is the cap by device, measured on the 2-core CI machine
against ``torch.optim.Muon``'s per-matrix loop; :func:`batch_runs` cuts a bucket's
entries by it, in order. The engine batches by them
(:func:`~dmuon.optim.batches.step_bucket`), and the planner counts and prices the same
calls by them (:mod:`dmuon.optim.planner.rule_calls`, :mod:`dmuon.optim.planner.traffic`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def default_batch_elements(device: torch.device | str) -> int:
    """How many matrix entries one batched rule call may hold, by device.

    On a GPU one call should hold every matrix of a shape (launch overhead,
    occupancy). On a CPU the matmuls of one large matrix already keep the cores
    busy, and stacking more only streams the batch through DRAM instead of the
    caches: on the 2-core CI machine (1 thread), 32 stacked 2048 × 512 matrices took
    1.27× ``torch.optim.Muon``'s per-matrix loop, and 0.79× when cut into one
    matrix per call, while 32 small 128 × 512 ones took 0.46× in calls of 2²⁰
    entries and 0.91× in calls of one. CPU batches are therefore capped at 2²⁰
    entries (4 MiB of fp32): large matrices run one by one, small ones by the
    dozen.

    Examples:
        >>> default_batch_elements("cpu")
        1048576
    """
    return 1 << 20 if torch.device(device).type == "cpu" else 1 << 62


def batch_runs(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """How a bucket's entries are cut into batched rule calls: the indices of ``sizes``
    in consecutive runs of at most ``limit`` in total (matrix entries), at least one
    index each (an entry larger than ``limit`` is a run of its own).

    :func:`step_bucket` batches by it, and the planner counts the rule calls and the
    sign votes it prices by it (:mod:`dmuon.optim.planner.rule_calls`,
    :mod:`dmuon.optim.planner.traffic`).

    Examples:
        >>> batch_runs([4, 4, 4, 9, 1], 8)
        [[0, 1], [2], [3], [4]]
    """
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, c in enumerate(sizes):
        if cur and size + c > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += c
    if cur:
        out.append(cur)
    return out
