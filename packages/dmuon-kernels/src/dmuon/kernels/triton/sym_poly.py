"""``sym_poly(A, b, c, a) = b·A + c·A² + a·I`` for symmetric ``A`` with Triton."""

from __future__ import annotations

import torch

from dmuon.kernels.triton.symmetric_matmul import (
    as_batch,
    check_operand,
    check_out,
    lower_tile_matmul,
)

__all__ = ["sym_poly"]


def sym_poly(
    A: torch.Tensor, b: float, c: float, a: float = 0.0, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The Newton–Schulz polynomial ``b·A + c·A² + a·I`` of a symmetric matrix (or batch).

    This is ``B = bA + cA²`` of a standard Newton–Schulz step and ``Z = bR + cR²`` of
    Gram Newton–Schulz; with ``a ≠ 0`` it is directly ``Q = aI + bR + cR²``, the first
    factor of a Gram window. ``A² = A Aᵀ`` for symmetric ``A``, so only the lower
    tiles are computed and mirrored; the ``b·A`` and ``a·I`` terms are added to the
    fp32 accumulator before the one rounding (microsoft/dion ``ns_line_2``).

    ``A`` must be symmetric; this is not checked (it would cost a pass over ``A``),
    and for a non-symmetric ``A`` the result is the symmetric matrix built from the
    lower triangle of ``bA + cA²``.

    Args:
        A: ``(m, m)`` or ``(B, m, m)`` symmetric, float16/bfloat16/float32, contiguous,
            on CUDA (or on the CPU under ``TRITON_INTERPRET=1``).
        b: coefficient of ``A``.
        c: coefficient of ``A²``.
        a: coefficient of the identity (default 0).
        out: optional contiguous result buffer of ``A``'s shape, dtype and device.

    Raises:
        ValueError: ``A`` is not square, or has the wrong rank, dtype, device or layout.

    Examples:
        >>> import torch
        >>> from dmuon.kernels.triton import sym_poly
        >>> X = torch.randn(1024, 4096, device="cuda", dtype=torch.float16)
        >>> A = X @ X.mT / 4096
        >>> Z = sym_poly(A, -4.775, 2.0315)  # == -4.775*A + 2.0315*A@A
    """
    check_operand("A", A, op="sym_poly", square=True, what="(m, m) matrix or (B, m, m) batch")
    check_out(out, A, tuple(A.shape), "sym_poly")
    A3 = as_batch(A)
    C = lower_tile_matmul(
        A3, A3, alpha=c, beta=b, diag=a, out=None if out is None else as_batch(out), op="sym_poly"
    )
    return C if A.ndim == 3 else C.squeeze(0)
