"""The symmetric products of the Newton–Schulz iterations, as one swappable set.

Both iterations spend almost all their time in three kinds of product, each of
which has a symmetric result:

* ``syrk(X) = X Xᵀ`` — the Gram matrix of a wide ``(B, m, k)`` batch;
* ``sym_poly(A, b, c, a) = b·A + c·A² + a·I`` — the polynomial step on a symmetric
  ``A`` (``Z = bR + cR²`` in Gram Newton–Schulz, ``B = bA + cA²`` in the standard one);
* ``sym_mul(A, B, a) = A·B + a·A`` for *commuting* symmetric ``A`` and ``B`` — then
  ``A·B = B·A`` is symmetric (``R·Z + aR``, ``Q·Z + aQ`` and ``RZ·Z + a·RZ`` in Gram
  Newton–Schulz, where every matrix is a polynomial in the same ``R``).

A :class:`SymmetricOps` bundles one implementation of the three. :data:`TORCH_OPS`
is the plain-torch (cuBLAS on CUDA) form the iterations use by default; the Triton
kernels in :mod:`dmuon.kernels.triton` compute only the lower-triangle tiles and
mirror them (about half the work, Dao-AILab *Gram Newton–Schulz* 2026; flash-muon).
The product ``Q·X`` with the wide ``X`` is not symmetric and always stays on the
vendor GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["TORCH_OPS", "SymmetricOps", "sym_mul_torch", "sym_poly_torch", "syrk_torch"]


@dataclass(frozen=True)
class SymmetricOps:
    """One implementation of the three symmetric products (all on ``(B, ·, ·)`` batches).

    Attributes:
        name: short name used in autotune decisions and CUDA-graph keys.
        syrk: ``X ↦ X Xᵀ``.
        sym_poly: ``(A, b, c, a) ↦ b·A + c·A² + a·I`` for symmetric ``A``.
        sym_mul: ``(A, B, a) ↦ A·B + a·A`` for commuting symmetric ``A``, ``B``.

    Examples:
        >>> import torch
        >>> from dmuon.kernels import TORCH_OPS
        >>> X = torch.randn(2, 3, 5)
        >>> TORCH_OPS.syrk(X).shape
        torch.Size([2, 3, 3])
    """

    name: str
    syrk: Callable[[torch.Tensor], torch.Tensor]
    sym_poly: Callable[[torch.Tensor, float, float, float], torch.Tensor]
    sym_mul: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def syrk_torch(X: torch.Tensor) -> torch.Tensor:
    """``X Xᵀ`` for a ``(B, m, k)`` batch with the vendor GEMM.

    Examples:
        >>> import torch
        >>> from dmuon.kernels import syrk_torch
        >>> syrk_torch(torch.ones(1, 2, 3))
        tensor([[[3., 3.],
                 [3., 3.]]])
    """
    return torch.bmm(X, X.mT)


def sym_poly_torch(A: torch.Tensor, b: float, c: float, a: float = 0.0) -> torch.Tensor:
    """``b·A + c·A² + a·I`` for a ``(B, m, m)`` batch with the vendor GEMM (one ``baddbmm``).

    Examples:
        >>> import torch
        >>> from dmuon.kernels import sym_poly_torch
        >>> A = 2 * torch.eye(2).unsqueeze(0)
        >>> sym_poly_torch(A, b=1.0, c=0.5, a=1.0)[0]  # 1·2 + 0.5·4 + 1 on the diagonal
        tensor([[5., 0.],
                [0., 5.]])
    """
    Z = torch.baddbmm(A, A, A, beta=b, alpha=c)
    if a != 0.0:
        Z.diagonal(dim1=-2, dim2=-1).add_(a)
    return Z


def sym_mul_torch(A: torch.Tensor, B: torch.Tensor, a: float) -> torch.Tensor:
    """``A·B + a·A`` for ``(B, m, m)`` batches with the vendor GEMM (one ``baddbmm``).

    Examples:
        >>> import torch
        >>> from dmuon.kernels import sym_mul_torch
        >>> A, B = torch.eye(2).unsqueeze(0), 3 * torch.eye(2).unsqueeze(0)
        >>> sym_mul_torch(A, B, a=0.5)[0]
        tensor([[3.5000, 0.0000],
                [0.0000, 3.5000]])
    """
    return torch.baddbmm(A, A, B, beta=a)


TORCH_OPS = SymmetricOps("torch", syrk_torch, sym_poly_torch, sym_mul_torch)
"""The plain-torch products: ``bmm``/``baddbmm`` (cuBLAS on CUDA)."""
