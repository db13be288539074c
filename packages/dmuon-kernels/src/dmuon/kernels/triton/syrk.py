"""``syrk(X) = X Xᵀ`` with Triton, computing only the lower-triangle tiles."""

from __future__ import annotations

import torch

from dmuon.kernels.triton.symmetric_matmul import (
    as_batch,
    check_operand,
    check_out,
    lower_tile_matmul,
)

__all__ = ["syrk"]


def syrk(X: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric rank-k product ``C = X Xᵀ`` of a matrix or of every matrix in a batch.

    ``C_ij = Σ_k X_ik X_jk``. Only the ``T(T+1)/2`` tiles on or below the diagonal
    are computed (``T = ⌈m / BLOCK⌉``) and mirrored above it, about half the work
    of ``X @ X.mT``; the result is exactly symmetric. Accumulation in fp32, one
    rounding to ``X.dtype`` (BLAS ``?syrk``; flash-muon ``mmt_kernel``).

    Args:
        X: ``(m, k)`` or ``(B, m, k)``, float16/bfloat16/float32, contiguous, on CUDA
            (or on the CPU under ``TRITON_INTERPRET=1``).
        out: optional contiguous ``(…, m, m)`` result buffer of ``X``'s dtype and device.

    Returns:
        ``(m, m)`` or ``(B, m, m)`` in ``X.dtype``.

    Raises:
        ValueError: ``X`` has the wrong rank, dtype, device or memory layout, or
            ``out`` does not match.

    Examples:
        >>> import torch
        >>> from dmuon.kernels.triton import syrk
        >>> X = torch.randn(4, 1024, 4096, device="cuda", dtype=torch.float16)  # on a GPU
        >>> C = syrk(X)  # == X @ X.mT up to rounding
    """
    check_operand("X", X, op="syrk", square=False)
    check_out(out, X, (*X.shape[:-1], X.shape[-2]), "syrk")
    X3 = as_batch(X)
    C = lower_tile_matmul(
        X3,
        X3.mT,
        alpha=1.0,
        beta=0.0,
        diag=0.0,
        out=None if out is None else as_batch(out),
        op="syrk",
    )
    return C if X.ndim == 3 else C.squeeze(0)
