"""The standard quintic Newton–Schulz iteration for the polar factor.

For ``G = U Σ Vᵀ`` the polar factor is ``U Vᵀ``. After normalising so that
``‖X‖_2 ≤ 1``, each step

    A = X Xᵀ,    B = b·A + c·A²,    X ← a·X + B X

applies the odd polynomial ``p(σ) = aσ + bσ³ + cσ⁵`` to every singular value
and leaves the singular vectors alone (K. Jordan, *Muon*, 2024; Bernstein &
Newhouse, "Old optimizer, new norm", 2024). Working in the wide orientation
(rows ≤ cols) keeps ``A`` the small ``m × m`` matrix: one step costs
``4m²n + 2m³`` FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.kernels._layout import left_product
from dmuon.kernels.coefficients import Schedule
from dmuon.kernels.dispatch import run
from dmuon.kernels.ns_options import DEFAULTS, NSOptions
from dmuon.kernels.symmetric_ops import TORCH_OPS, SymmetricOps

__all__ = ["newton_schulz", "newton_schulz_iterations", "standard_iterations"]


def newton_schulz_iterations(
    X: torch.Tensor, schedule: Schedule, ops: SymmetricOps = TORCH_OPS
) -> torch.Tensor:
    """Run the quintic steps on a prepared batch ``X`` of shape ``(B, m, n)``, ``m ≤ n``.

    ``X`` must already be normalised (``‖X_b‖_2 ≤ 1``) and in the compute dtype;
    it is not modified. Each step is three batched products, two of them fused
    with the scaling: ``A = X Xᵀ`` (``ops.syrk``), ``B = bA + cA²`` (``ops.sym_poly``)
    and ``X ← aX + B X`` (always the vendor ``baddbmm``: not symmetric), written in
    ``X``'s own layout (a tall matrix's transposed view stays tall,
    :func:`~dmuon.kernels._layout.left_product`).
    """
    for a, b, c in schedule:
        A = ops.syrk(X)
        B = ops.sym_poly(A, b, c, 0.0)
        X = left_product(B, X, beta=a)
    return X


def standard_iterations(
    X: torch.Tensor, schedule: Schedule, restarts: tuple[int, ...], ops: SymmetricOps
) -> torch.Tensor:
    """:func:`newton_schulz_iterations` as :func:`~dmuon.kernels.dispatch.run` calls every
    iteration, ``(X, schedule, restarts, ops)``; the standard iteration has no restarts."""
    return newton_schulz_iterations(X, schedule, ops)


def newton_schulz(
    G: torch.Tensor,
    *,
    coefficients: str | Sequence[Sequence[float]] = DEFAULTS.coefficients,
    steps: int = DEFAULTS.steps,
    eps: float = DEFAULTS.eps,
    compute_dtype: torch.dtype | None = DEFAULTS.compute_dtype,
    backend: str = DEFAULTS.backend,
    cuda_graph: bool | None = DEFAULTS.cuda_graph,
) -> torch.Tensor:
    """Approximate the polar factor ``U Vᵀ`` of ``G`` (or of each matrix of a batch).

    ``X₀ = G / (‖G‖_F + eps·max|G|)``, then ``X ← aX + b(XXᵀ)X + c(XXᵀ)²X`` for each
    ``(a, b, c)`` of the schedule. Tall matrices are transposed to the wide
    orientation and back.

    Args:
        G: ``(..., m, n)`` real floating tensor.
        coefficients: a name from :data:`~dmuon.kernels.COEFFICIENT_SETS` or explicit triples.
        steps: number of iterations.
        eps: relative guard of the normalisation (see :func:`~dmuon.kernels.orthogonalize`).
        compute_dtype: dtype of the matmuls; default from
            :func:`~dmuon.kernels.default_compute_dtype` for ``method="standard"``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see
            :func:`~dmuon.kernels.orthogonalize`).
        cuda_graph: capture and replay the call as a CUDA graph (see
            :func:`~dmuon.kernels.orthogonalize`).

    Returns:
        A tensor of ``G``'s shape and dtype.

    Examples:
        >>> import torch
        >>> O = newton_schulz(torch.randn(64, 256), compute_dtype=torch.float32)
        >>> O.shape
        torch.Size([64, 256])
    """
    options = NSOptions(coefficients, steps, (), eps, compute_dtype, backend, cuda_graph)
    return run(G, "standard", standard_iterations, options)
