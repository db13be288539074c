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
* **CPU with native bf16 (AVX-512-BF16 or AMX on x86, the BF16 extension on
  Arm) → bf16 for both.** fp16 matmul on common CPUs has no fast kernel and can
  be hundreds of times slower than bf16.
* **CPU without native bf16 → fp32.** There bf16 matmul is emulated: on an
  AVX2-only AMD EPYC a 384×1152 by 1152×384 product took 0.58 s in bf16 and
  0.039 s in fp32 (torch 2.13), so bf16 would be slower *and* less accurate.
* **anything else → fp32.**

Pass ``compute_dtype=torch.float32`` (or float64) to any entry point to override.
"""

from __future__ import annotations

import functools
import pathlib
import platform

import torch

__all__ = ["cpu_has_native_bf16", "default_compute_dtype"]

_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; "bf16" is Arm's Features


def _native_bf16_in_cpuinfo(text: str) -> bool:
    """Whether the ``flags`` (x86) or ``Features`` (Arm) line of a ``/proc/cpuinfo``
    text names a native bf16 instruction set."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return bool(_BF16_FLAGS & set(value.split()))
    return False


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512-BF16, AMX-BF16, Arm BF16).

    Read from ``/proc/cpuinfo`` (Linux), the kernel's list of CPU flags; on macOS
    taken as yes for ``arm64`` (Apple M2 and later have BF16); ``False`` where
    neither tells. Cached for the process.

    Examples:
        >>> isinstance(cpu_has_native_bf16(), bool)
        True
    """
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.system() == "Darwin" and platform.machine() == "arm64"
    return _native_bf16_in_cpuinfo(text)


def default_compute_dtype(device: torch.device | str, method: str = "gram") -> torch.dtype:
    """The compute dtype :func:`~dmuon.kernels.orthogonalize` uses when none is given.

    Examples:
        >>> default_compute_dtype("cuda")
        torch.float16
        >>> default_compute_dtype("cpu") == (
        ...     torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
        True
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.float16 if method == "gram" else torch.bfloat16
    if kind == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32
