"""``sym_mul(A, B, a) = A·B + a·A`` for commuting symmetric ``A``, ``B`` with Triton."""

from __future__ import annotations

import torch

from dmuon.kernels.triton.symmetric_matmul import (
    as_batch,
    check_operand,
    check_out,
    lower_tile_matmul,
)

__all__ = ["sym_mul"]


def sym_mul(
    A: torch.Tensor, B: torch.Tensor, a: float = 0.0, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``A·B + a·A`` when ``A`` and ``B`` are commuting symmetric matrices (or batches).

    If ``A`` and ``B`` are symmetric and commute, ``(AB)ᵀ = BA = AB``: the product is
    symmetric and only its lower tiles need computing. In Gram Newton–Schulz every
    ``m × m`` matrix (``R``, ``Z = bR + cR²``, ``Q``, ``RZ``) is a polynomial in the
    same ``R``, so the products ``Q·Z + aQ``, ``R·Z + aR`` and ``RZ·Z + a·RZ`` qualify
    (Zhang, Amsel, Chen, Dao, *Gram Newton–Schulz*, 2026). Neither property is
    checked; for other inputs the result is the symmetric matrix built from the
    lower triangle of ``AB + aA``.

    Args:
        A: ``(m, m)`` or ``(B, m, m)``, float16/bfloat16/float32, contiguous, on CUDA
            (or on the CPU under ``TRITON_INTERPRET=1``).
        B: same shape, dtype and device as ``A``.
        a: coefficient of ``A`` (default 0).
        out: optional contiguous result buffer of ``A``'s shape, dtype and device.

    Raises:
        ValueError: ``A`` or ``B`` is not square, they differ in shape, dtype or
            device, or either has the wrong rank, dtype, device or layout.

    Examples:
        >>> import torch
        >>> from dmuon.kernels.triton import sym_mul, sym_poly
        >>> R = torch.eye(512, device="cuda", dtype=torch.float16)
        >>> Z = sym_poly(R, -4.775, 2.0315)
        >>> RZ = sym_mul(R, Z, 3.4445)  # R·(aI + Z)
    """
    what = "(m, m) matrix or (B, m, m) batch"
    check_operand("A", A, op="sym_mul", square=True, what=what)
    check_operand("B", B, op="sym_mul", square=True, what=what)
    if A.shape != B.shape or A.dtype != B.dtype or A.device != B.device:
        raise ValueError(
            "sym_mul: A and B must have the same shape, dtype and device, got "
            f"{tuple(A.shape)} {A.dtype} on {A.device} and {tuple(B.shape)} {B.dtype} on {B.device}"
        )
    check_out(out, A, tuple(A.shape), "sym_mul")
    C = lower_tile_matmul(
        as_batch(A),
        as_batch(B),
        alpha=1.0,
        beta=a,
        diag=0.0,
        out=None if out is None else as_batch(out),
        op="sym_mul",
    )
    return C if A.ndim == 3 else C.squeeze(0)
