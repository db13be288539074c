"""Which floating-point type the Newton–Schulz matmuls run in.

After normalisation every entry of ``X`` is at most 1 in magnitude and the
iteration keeps singular values near 1, so the range of bf16 is not needed and
its mantissa is the limit. What is fast differs by device:

* **CUDA, Gram Newton–Schulz → fp16.** The Gram iteration multiplies small
  symmetric matrices whose errors compound; fp16's 10-bit mantissa (vs bf16's 7)
  keeps the evolved Gram matrix usable until the restart (Dao-AILab Gram NS,
  DMuon release). Tensor cores run fp16 and bf16 at the same rate.
* **CUDA, standard Newton–Schulz → bf16**, the choice of Keller Jordan's Muon,
  Moonlight and ``torch.optim.Muon``.
* **CPU → bf16 for both.** fp16 matmul on common CPUs has no fast kernel and can
  be hundreds of times slower than bf16; bf16 uses AMX/AVX-512-BF16 where present.
* **anything else → fp32.**

Pass ``compute_dtype=torch.float32`` (or float64) to any entry point to override.
"""

from __future__ import annotations

import torch

__all__ = ["default_compute_dtype"]


def default_compute_dtype(device: torch.device | str, method: str = "gram") -> torch.dtype:
    """The compute dtype :func:`~dmuon.kernels.orthogonalize` uses when none is given.

    Example:
        >>> default_compute_dtype("cpu")
        torch.bfloat16
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.float16 if method == "gram" else torch.bfloat16
    if kind == "cpu":
        return torch.bfloat16
    return torch.float32
