"""The backend rule: which implementation of the symmetric products a call uses.

``backend="torch"`` always uses :data:`~dmuon.kernels.TORCH_OPS`. ``"triton"``
always uses the Triton kernels and says clearly why it cannot when it cannot.
``"auto"`` takes torch, silently, whenever Triton cannot help:

* the tensor is not on CUDA (the CPU, MPS, …);
* the compute dtype is not fp16, bf16 or fp32;
* the Gram matrix is smaller than one tile (``min(m, n) < MIN_TRITON_SIZE``): the
  kernel would be one partial tile, and launch cost dominates anyway;
* Triton is not installed (or fails to import).

Otherwise ``"auto"`` hands the decision to the per-shape autotuner
(:mod:`dmuon.kernels.autotune`).
"""

from __future__ import annotations

import functools
import logging

import torch

from dmuon.kernels.symmetric_ops import SymmetricOps

__all__ = [
    "BACKENDS",
    "MIN_TRITON_SIZE",
    "TRITON_DTYPES",
    "resolve_backend",
    "triton_available",
    "triton_candidates",
]

BACKENDS = ("auto", "torch", "triton")
"""Values of the ``backend=`` argument: ``"auto"`` tunes per shape on CUDA and is the
torch path elsewhere; ``"torch"`` and ``"triton"`` force one."""
MIN_TRITON_SIZE = 64
"""Smallest Gram size ``min(m, n)`` for which ``"auto"`` considers Triton: the
smallest tile side of the GPU configs."""
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_log = logging.getLogger("dmuon.kernels")
_INSTALL_HINT = "pip install 'dmuon-kernels[triton]'"


@functools.cache
def _load_triton() -> tuple[tuple[dict[str, SymmetricOps], bool] | None, str]:
    """Import the Triton subpackage once; (candidates, interpreting) or the import error."""
    try:
        # Imported here, not at module level: Triton is optional and slow to import.
        from dmuon.kernels.triton import INTERPRETING, TRITON_OPS, TRITON_SYRK_OPS
    except ImportError as exc:
        _log.debug("Triton backend unavailable: %s", exc)
        return None, str(exc)
    return ({TRITON_OPS.name: TRITON_OPS, TRITON_SYRK_OPS.name: TRITON_SYRK_OPS}, INTERPRETING), ""


def triton_available() -> bool:
    """Whether the Triton kernels can be imported (Triton installed and importable).

    Examples:
        >>> from dmuon.kernels import triton_available
        >>> isinstance(triton_available(), bool)
        True
    """
    return _load_triton()[0] is not None


def triton_candidates() -> dict[str, SymmetricOps]:
    """The Triton :class:`~dmuon.kernels.SymmetricOps` by name; raises if Triton is missing."""
    loaded, error = _load_triton()
    if loaded is None:
        hint = "" if _INSTALL_HINT in error else f"; {_INSTALL_HINT}"  # said once
        raise ValueError(f"backend='triton' needs Triton ({error}){hint}")
    return dict(loaded[0])


def resolve_backend(
    backend: str,
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    gram_size: int,
    triton_ok=triton_available,
) -> str:
    """Apply the backend rule: ``"torch"``, ``"triton"`` or ``"tune"`` (ask the autotuner).

    ``triton_ok`` is only called when the answer depends on it (so a CPU call never
    imports Triton).

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`, or ``"triton"`` was
            asked for where it cannot run.

    Examples:
        >>> import torch
        >>> from dmuon.kernels import resolve_backend
        >>> resolve_backend("auto", device=torch.device("cpu"), compute_dtype=torch.bfloat16,
        ...                 gram_size=1024)
        'torch'
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "triton":
        triton_candidates()  # raises with the install hint if Triton is missing
        loaded = _load_triton()[0]
        interpreting = loaded is not None and loaded[1]
        if device.type != "cuda" and not interpreting:
            raise ValueError(
                f"backend='triton' needs a CUDA tensor, got one on {device}; set "
                "TRITON_INTERPRET=1 before the first import of dmuon.kernels.triton to "
                "run the kernels on the CPU in Triton's interpreter, or use backend='auto'"
            )
        if compute_dtype not in TRITON_DTYPES:
            raise ValueError(
                "backend='triton' computes in float16, bfloat16 or float32, got "
                f"compute_dtype={compute_dtype}; use backend='torch' for it"
            )
        return "triton"
    if device.type != "cuda" or compute_dtype not in TRITON_DTYPES:
        return "torch"
    if gram_size < MIN_TRITON_SIZE or not triton_ok():
        return "torch"
    return "tune"
