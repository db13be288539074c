"""The one entry point the optimizer and researchers call."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.kernels._layout import empty_result, restore, to_wide_normalized
from dmuon.kernels.coefficients import resolve_coefficients
from dmuon.kernels.gram_newton_schulz import check_restarts, gram_newton_schulz_iterations
from dmuon.kernels.newton_schulz import newton_schulz_iterations

__all__ = ["METHODS", "orthogonalize"]

METHODS = ("gram", "standard")


def orthogonalize(
    G: torch.Tensor,
    *,
    method: str = "gram",
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    steps: int = 5,
    restarts: Sequence[int] = (2,),
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximate the polar factor ``U Vᵀ`` of a matrix or of every matrix in a batch.

    1. ``X = G / (‖G‖_F + eps·max|G|)`` in fp32 (fp64 for fp64 input), per matrix;
       dividing by the largest entry first keeps the norm finite for entries from
       1e-30 to 1e30 and makes the result scale-invariant.
    2. Transpose tall matrices to the wide orientation (rows ≤ cols).
    3. Cast to the compute dtype and run ``steps`` quintic Newton–Schulz steps,
       either directly (``method="standard"``) or on the Gram matrix
       (``method="gram"``, :func:`~dmuon.kernels.gram_newton_schulz`).
    4. Transpose back and cast to ``G.dtype``.

    The result is ``U φ(Σ) Vᵀ`` where ``φ`` is the composed scalar polynomial
    (:func:`~dmuon.kernels.ns_scalar_map`); its band for each coefficient set is
    listed in :data:`~dmuon.kernels.COEFFICIENT_SETS`. A batch ``(..., m, n)`` runs
    as one batched call (no Python loop over matrices). A zero matrix gives zeros;
    an input with a zero-sized dimension gives an empty result.

    Args:
        G: ``(..., m, n)`` real floating tensor (fp16, bf16, fp32 or fp64).
        method: ``"gram"`` (default) or ``"standard"``.
        coefficients: coefficient-set name or explicit ``(a, b, c)`` triples.
        steps: number of Newton–Schulz steps.
        restarts: Gram restarts (ignored by ``"standard"``).
        eps: relative guard of the normalisation.
        compute_dtype: dtype of the matmuls; default per device and method, see
            :func:`~dmuon.kernels.default_compute_dtype`.

    Raises:
        ValueError: ``G`` has fewer than 2 dimensions, is not real floating point,
            or ``method``/``coefficients``/``steps``/``restarts`` are invalid.

    Example:
        >>> import torch
        >>> from dmuon.kernels import orthogonalize, polar_factor
        >>> G = torch.randn(128, 512)
        >>> O = orthogonalize(G, compute_dtype=torch.float32)
        >>> torch.linalg.svdvals(O).min() > 0.7
        tensor(True)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    schedule = resolve_coefficients(coefficients, steps)
    restarts_t = check_restarts(restarts, steps) if method == "gram" else ()
    if G.numel() == 0:
        return empty_result(G)
    X, layout = to_wide_normalized(G, eps, compute_dtype, method)
    if method == "gram":
        X = gram_newton_schulz_iterations(X, schedule, restarts_t)
    else:
        X = newton_schulz_iterations(X, schedule)
    return restore(X, layout)
