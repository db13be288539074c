"""The Triton symmetric products as :class:`~dmuon.kernels.SymmetricOps` candidates."""

from __future__ import annotations

from dmuon.kernels.symmetric_ops import SymmetricOps, sym_mul_torch, sym_poly_torch
from dmuon.kernels.triton.sym_mul import sym_mul
from dmuon.kernels.triton.sym_poly import sym_poly
from dmuon.kernels.triton.syrk import syrk

__all__ = ["TRITON_OPS", "TRITON_SYRK_OPS"]

TRITON_OPS = SymmetricOps("triton", syrk, sym_poly, sym_mul)
"""Every symmetric product in Triton."""

TRITON_SYRK_OPS = SymmetricOps("triton_syrk", syrk, sym_poly_torch, sym_mul_torch)
"""Only ``X Xᵀ`` (the one product with the long ``n`` dimension) in Triton; the
``m × m`` products on the vendor GEMM. Wins where the small products are too small
for the Triton tiles to pay."""
