"""Triton symmetric kernels for the Newton–Schulz iterations.

Optional: ``pip install 'dmuon-kernels[triton]'``.

Importing this subpackage imports Triton; :mod:`dmuon.kernels` itself never does
unless a Triton backend is asked for.
"""

from dmuon.kernels.triton._configs import AMPERE, HOPPER, INTERPRETER, TileConfig
from dmuon.kernels.triton.ops import TRITON_OPS, TRITON_SYRK_OPS
from dmuon.kernels.triton.sym_mul import sym_mul
from dmuon.kernels.triton.sym_poly import sym_poly
from dmuon.kernels.triton.symmetric_matmul import INTERPRETING
from dmuon.kernels.triton.syrk import syrk

__all__ = [
    "AMPERE",
    "HOPPER",
    "INTERPRETER",
    "INTERPRETING",
    "TRITON_OPS",
    "TRITON_SYRK_OPS",
    "TileConfig",
    "sym_mul",
    "sym_poly",
    "syrk",
]
