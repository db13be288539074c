"""Gram Newton–Schulz: the quintic iteration carried out on the small Gram matrix.

With ``R = X Xᵀ`` (``m × m`` for a wide ``m × n`` matrix) and ``Z = bR + cR²``, one
Newton–Schulz step is ``X' = (aI + Z) X`` and the next Gram matrix is

    R' = X' X'ᵀ = (aI + Z) R (aI + Z).

``R`` and ``Z`` are polynomials in the same symmetric matrix, so they commute and
the whole iteration can stay in ``m × m`` space: accumulate
``Q = Π_k (a_k I + Z_k)`` and touch the ``m × n`` matrix only at the start, at a
restart and at the end (``X ← Q X``). For aspect ratio ``n/m = 4`` this is
``60m³`` FLOPs against the standard iteration's ``90m³`` (see :func:`ns_flops`).

In half precision the evolved ``R`` drifts (spurious negative eigenvalues), so
at each *restart* iteration ``X ← Q X`` is applied and ``R = X Xᵀ`` recomputed
exactly. One restart at iteration 2 suffices for five-step schedules
(Zhang, Amsel, Chen, Dao, "Gram Newton–Schulz", 2026; Dao-AILab/gram-newton-schulz).

Square matrices gain nothing (the Gram matrix is as large as ``X``) and run the
standard iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dmuon.kernels._layout import left_product
from dmuon.kernels.coefficients import Schedule
from dmuon.kernels.dispatch import run
from dmuon.kernels.newton_schulz import newton_schulz_iterations
from dmuon.kernels.ns_options import DEFAULTS, NSOptions, check_restarts
from dmuon.kernels.symmetric_ops import TORCH_OPS, SymmetricOps

__all__ = [
    "check_restarts",
    "gram_iterations",
    "gram_newton_schulz",
    "gram_newton_schulz_iterations",
]


def _add_identity(M: torch.Tensor, a: float) -> torch.Tensor:
    M.diagonal(dim1=-2, dim2=-1).add_(a)
    return M


def gram_newton_schulz_iterations(
    X: torch.Tensor,
    schedule: Schedule,
    restarts: tuple[int, ...] = (2,),
    ops: SymmetricOps = TORCH_OPS,
) -> torch.Tensor:
    """Run Gram Newton–Schulz on a prepared ``(B, m, n)`` batch with ``m ≤ n``.

    ``X`` must be normalised and in the compute dtype; it is not modified.
    Square batches run :func:`newton_schulz_iterations`. Every ``m × m`` product is
    symmetric and goes through ``ops`` (``R = X Xᵀ``, ``Z = bR + cR²``,
    ``Q·Z + aQ``, ``R·Z + aR``, ``RZ·Z + a·RZ``); only ``Q·X`` uses the vendor GEMM.
    """
    m, n = X.shape[-2], X.shape[-1]
    if m == n:
        return newton_schulz_iterations(X, schedule, ops)
    return gram_iterations(X, schedule, restarts, ops, ops.syrk)


def gram_iterations(
    X: torch.Tensor,
    schedule: Schedule,
    restarts: tuple[int, ...],
    ops: SymmetricOps,
    gram: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The Gram iteration on ``X`` of any shape, with ``R = gram(X)``.

    ``gram`` is ``ops.syrk`` on a whole matrix; on a column shard ``X_i`` of a
    tensor-parallel matrix it is ``Σ_j X_j X_jᵀ`` over the shards
    (:func:`~dmuon.kernels.tp_gram_newton_schulz`), and the result is that shard of
    the whole result. Every call of ``gram`` happens in the same order on every shard.
    """
    last = len(schedule) - 1
    R = gram(X)
    Q: torch.Tensor | None = None
    for i, (a, b, c) in enumerate(schedule):
        if i in restarts and Q is not None:
            X = left_product(Q, X)
            R = gram(X)
            Q = None
        evolve = i < last and (i + 1) not in restarts
        if Q is None and not evolve:
            Q = ops.sym_poly(R, b, c, a)  # Q = aI + bR + cR², Z itself is not needed
            continue
        Z = ops.sym_poly(R, b, c, 0.0)  # Z = bR + cR²
        Q = _add_identity(Z.clone(), a) if Q is None else ops.sym_mul(Q, Z, a)
        if evolve:
            # R' = (aI + Z) R (aI + Z); Z, R and RZ commute, so both products are symmetric.
            RZ = ops.sym_mul(R, Z, a)  # R(aI + Z)
            R = ops.sym_mul(RZ, Z, a)  # RZ(aI + Z)
    assert Q is not None
    return left_product(Q, X)


def gram_newton_schulz(
    G: torch.Tensor,
    *,
    coefficients: str | Sequence[Sequence[float]] = DEFAULTS.coefficients,
    steps: int = DEFAULTS.steps,
    restarts: Sequence[int] | None = DEFAULTS.restarts,
    eps: float = DEFAULTS.eps,
    compute_dtype: torch.dtype | None = DEFAULTS.compute_dtype,
    backend: str = DEFAULTS.backend,
    cuda_graph: bool | None = DEFAULTS.cuda_graph,
) -> torch.Tensor:
    """Approximate the polar factor of ``G`` with Gram Newton–Schulz.

    Mathematically the same map as :func:`~dmuon.kernels.newton_schulz` with the
    same coefficients (``U φ(Σ) Vᵀ``); it differs only in rounding.

    Args:
        G: ``(..., m, n)`` real floating tensor.
        coefficients: a name from :data:`~dmuon.kernels.COEFFICIENT_SETS` or explicit triples.
        steps: number of iterations.
        restarts: iterations at which ``X`` is re-formed and ``R`` recomputed exactly
            (``()`` for none); ``None`` (default): one, at iteration 2, or 3 in bf16
            (:func:`~dmuon.kernels.ns_options.default_restarts`).
        eps: relative guard of the normalisation.
        compute_dtype: dtype of the matmuls; default per device, see
            :func:`~dmuon.kernels.default_compute_dtype` (fp16 on CUDA; bf16 on CPUs
            with native bf16, fp32 on the others).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see
            :func:`~dmuon.kernels.orthogonalize`).
        cuda_graph: capture and replay the call as a CUDA graph (see
            :func:`~dmuon.kernels.orthogonalize`).

    Examples:
        >>> import torch
        >>> O = gram_newton_schulz(torch.randn(64, 512), compute_dtype=torch.float32)
        >>> O.shape
        torch.Size([64, 512])
    """
    options = NSOptions(coefficients, steps, restarts, eps, compute_dtype, backend, cuda_graph)
    return run(G, "gram", gram_newton_schulz_iterations, options)
