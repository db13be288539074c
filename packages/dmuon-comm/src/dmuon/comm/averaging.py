"""Where a mean over ranks divides: before the sum for fp16, after it otherwise.

The mean of ``N`` ranks' tensors is ``(Σ_r x_r) / N``. Summed first, fp16 (largest
finite value 65504) overflows to ``inf`` wherever the sum passes 65504 — at ``65504/N``
per rank, while the mean itself is finite — and a ``GradScaler``'s still-scaled fp16
gradients meet that ``N`` times sooner than under DDP, whose default communication hook
divides each rank's gradient by ``N`` before its all-reduce
(``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``). DMuon's
averaging collectives (:func:`~dmuon.comm.reduce_to_owners` with ``op="avg"``, owner
mode's all-reduced buckets, ``sign`` mode's scalar gradients) divide fp16 first, as DDP
does, and every other dtype after the sum (bf16 and fp32 have fp32's exponent range:
one rounding fewer, and the results they always gave).

Examples:
    >>> import torch
    >>> torch.float16 in DIVIDED_BEFORE_THE_SUM, torch.bfloat16 in DIVIDED_BEFORE_THE_SUM
    (True, False)
"""

from __future__ import annotations

import torch

__all__ = ["DIVIDED_BEFORE_THE_SUM"]

DIVIDED_BEFORE_THE_SUM: frozenset[torch.dtype] = frozenset({torch.float16})
"""The dtypes whose mean over ranks divides each rank's tensor before the sum (a set the
collectives read, ``b.dtype in DIVIDED_BEFORE_THE_SUM``, with no call per bucket)."""
