"""The one entry point the optimizer and researchers call."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.kernels.dispatch import run
from dmuon.kernels.gram_newton_schulz import gram_newton_schulz_iterations
from dmuon.kernels.newton_schulz import standard_iterations
from dmuon.kernels.ns_options import DEFAULTS, NSOptions

__all__ = ["METHODS", "orthogonalize"]

METHODS = ("gram", "standard")
"""Values of ``method=``: Gram Newton–Schulz (default) or the standard iteration."""


def orthogonalize(
    G: torch.Tensor,
    *,
    method: str = "gram",
    coefficients: str | Sequence[Sequence[float]] = DEFAULTS.coefficients,
    steps: int = DEFAULTS.steps,
    restarts: Sequence[int] | None = DEFAULTS.restarts,
    eps: float = DEFAULTS.eps,
    compute_dtype: torch.dtype | None = DEFAULTS.compute_dtype,
    backend: str = DEFAULTS.backend,
    cuda_graph: bool | None = DEFAULTS.cuda_graph,
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

    **Backends.** The symmetric products of the iteration (``X Xᵀ``, ``bA + cA²``,
    ``R·Z + aR``, ``Q·Z + aQ``) run either with torch (``bmm``/``baddbmm``, cuBLAS on
    CUDA) or with the Triton kernels of :mod:`dmuon.kernels.triton`, which compute
    one triangle and mirror it. ``backend="auto"`` (default) is torch off CUDA, without
    Triton, for compute dtypes other than fp16/bf16/fp32 and for Gram sizes below one
    tile (``min(m, n) < 64``); otherwise, the first time a shape is seen, it times the
    candidates against torch, rejects any that fails a numerical cross-check and
    remembers the winner in memory and on disk (:class:`~dmuon.kernels.Autotuner`).
    ``"torch"`` and ``"triton"`` force a path.

    **CUDA graphs.** On CUDA the whole call (normalisation, iteration, way back) is
    captured as a CUDA graph on its second call per (shape, dtype, device, options)
    and replayed afterwards, which removes the launch overhead of its ~25–40
    kernels. ``cuda_graph=False`` (or ``DMUON_NS_CUDA_GRAPH=0``) turns this off;
    :func:`~dmuon.kernels.release_cuda_graphs` frees the graphs. Nothing else is
    inside the graph: learning rate and weight decay are applied by the caller.

    The result is ``U φ(Σ) Vᵀ`` where ``φ`` is the composed scalar polynomial
    (:func:`~dmuon.kernels.ns_scalar_map`); its band for each coefficient set is
    listed in :data:`~dmuon.kernels.COEFFICIENT_SETS`. A batch ``(..., m, n)`` runs
    as one batched call (no Python loop over matrices). A zero matrix gives zeros;
    an input with a zero-sized dimension gives an empty result. A matrix holding a
    NaN or an infinity gives NaN in every entry of that matrix only (the others of the
    batch are unaffected); callers check finiteness first (``DMuon``'s step, by
    default, refuses a non-finite gradient before it is orthogonalised).

    Args:
        G: ``(..., m, n)`` real floating tensor (fp16, bf16, fp32 or fp64).
        method: ``"gram"`` (default) or ``"standard"``.
        coefficients: coefficient-set name or explicit ``(a, b, c)`` triples.
        steps: number of Newton–Schulz steps, 1 to
            :data:`~dmuon.kernels.coefficients.MAX_STEPS` (100).
        restarts: Gram restarts (ignored by ``"standard"``); ``None`` (default): one,
            at iteration 2, or 3 in bf16
            (:func:`~dmuon.kernels.ns_options.default_restarts`).
        eps: relative guard of the normalisation.
        compute_dtype: dtype of the matmuls; default per device and method, see
            :func:`~dmuon.kernels.default_compute_dtype`.
        backend: ``"auto"`` (default), ``"torch"`` or ``"triton"``.
        cuda_graph: ``None`` (default: on for CUDA unless disabled with
            :func:`~dmuon.kernels.set_cuda_graphs_enabled` or ``DMUON_NS_CUDA_GRAPH=0``),
            ``True`` or ``False``. Ignored off CUDA.

    Raises:
        ValueError: ``G`` has fewer than 2 dimensions, is not real floating point,
            or ``method``/``coefficients``/``steps``/``restarts``/``backend`` are
            invalid, or ``backend="triton"`` cannot run here (Triton missing, a CPU
            tensor outside the Triton interpreter, or a float64 compute dtype).

    Examples:
        >>> import torch
        >>> from dmuon.kernels import orthogonalize, polar_factor
        >>> G = torch.randn(128, 512)
        >>> O = orthogonalize(G, compute_dtype=torch.float32)
        >>> torch.linalg.svdvals(O).min() > 0.7
        tensor(True)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    iteration = gram_newton_schulz_iterations if method == "gram" else standard_iterations
    options = NSOptions(coefficients, steps, restarts, eps, compute_dtype, backend, cuda_graph)
    return run(G, method, iteration, options)
