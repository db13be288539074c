"""Clipping the singular values of a matrix without an SVD.

Hard clip, ``U min(Σ, τ) Vᵀ`` — the Frobenius projection onto the spectral-norm
ball of radius τ (MuCon, arXiv 2605.26459; F. Cesista, "Spectral clipping",
2025). Written with two Newton–Schulz primitives: with ``A = M Mᵀ`` (wide
orientation, ``m × m``), the spectral projector onto the directions whose
singular value exceeds τ is ``Π = (I + sign(A − τ²I)) / 2``, and

    clip_τ(M) = (I − Π) M + τ Π polar(M) = U min(Σ, τ) Vᵀ.

Singular values below τ pass through ``(I − Π) M`` exactly, however inaccurate
``polar(M)`` is for them; the sign is uncertain only for σ close to τ, where both
branches agree to within |σ − τ|.

Soft clip, ``U [σ / √(1 + σ²/τ²)] Vᵀ = (I + M Mᵀ/τ²)^{-1/2} M`` — the SPECTRA soft
clip (Jiang, Semenov, Stich, arXiv 2603.14315), computed with the coupled
Newton–Schulz iteration for the inverse square root (Higham, *Functions of
Matrices*, §6.3).
"""

from __future__ import annotations

import torch

from dmuon.kernels._layout import check_matrix_input, empty_result
from dmuon.kernels.orthogonalize import orthogonalize

__all__ = ["spectral_clip"]


def _eye_like(A: torch.Tensor) -> torch.Tensor:
    return torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)


def _hard_clip(M: torch.Tensor, tau: float, steps: int) -> torch.Tensor:
    A = M @ M.mT
    S = A - (tau * tau) * _eye_like(A)
    sign = orthogonalize(
        S, method="standard", coefficients="polar_express_raw", steps=steps, compute_dtype=M.dtype
    )
    sign = 0.5 * (sign + sign.mT)  # the exact sign of a symmetric matrix is symmetric
    P = orthogonalize(
        M, method="standard", coefficients="polar_express_raw", steps=steps, compute_dtype=M.dtype
    )
    PiM = 0.5 * (M + sign @ M)
    PiP = 0.5 * (P + sign @ P)
    return M - PiM + tau * PiP


def _inverse_sqrt_spd(C: torch.Tensor, steps: int) -> torch.Tensor:
    """Coupled Newton–Schulz: ``Y → (C/s)^{1/2}``, ``Z → (C/s)^{-1/2}`` with ``s ≥ ‖C‖_2``."""
    s = torch.linalg.matrix_norm(C, ord="fro", keepdim=True)
    I = _eye_like(C)
    Y, Z = C / s, I.clone()
    for _ in range(steps):
        T = 0.5 * (3.0 * I - Z @ Y)
        Y, Z = Y @ T, T @ Z
    return Z / s.sqrt()


def spectral_clip(
    M: torch.Tensor,
    tau: float = 1.0,
    *,
    mode: str = "hard",
    steps: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Clip the singular values of ``M`` (or of each matrix of a batch) at ``tau``.

    ``mode="hard"`` returns ``U min(Σ, τ) Vᵀ``; ``mode="soft"`` returns
    ``U [Σ (I + Σ²/τ²)^{-1/2}] Vᵀ``, which is ≈ Σ for σ ≪ τ and tends to τ for σ ≫ τ.
    Both use only matrix products (Newton–Schulz-type iterations); an SVD is
    used only by the tests, as the reference.

    Accuracy: hard clipping resolves singular values whose distance to τ, relative
    to ``‖MMᵀ − τ²I‖_F``, is above about 1e-4 with the default 12 steps; closer ones
    are mapped to a value between σ and τ. Soft clipping needs about
    ``log₂(1 + σ_max²/τ²) + 6`` steps (default 30).

    Args:
        M: ``(..., m, n)`` real floating tensor.
        tau: the clipping level, > 0.
        mode: ``"hard"`` or ``"soft"``.
        steps: iterations of each inner Newton–Schulz solve (default 12 hard, 30 soft).
        compute_dtype: dtype of the iterations; fp32 by default because the sign of
            ``MMᵀ − τ²I`` needs more precision than an orthogonalised update.

    Returns:
        A tensor of ``M``'s shape and dtype.

    Examples:
        >>> import torch
        >>> M = torch.randn(32, 64, dtype=torch.float64) * 3
        >>> torch.linalg.svdvals(spectral_clip(M, 1.0, compute_dtype=torch.float64)).max() < 1.001
        tensor(True)
    """
    check_matrix_input(M, "M")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau!r}")
    if mode not in ("hard", "soft"):
        raise ValueError(f"mode must be 'hard' or 'soft', got {mode!r}")
    if steps is None:
        steps = 12 if mode == "hard" else 30
    if M.numel() == 0:
        return empty_result(M)
    transposed = M.shape[-2] > M.shape[-1]
    X = (M.mT if transposed else M).to(compute_dtype)
    if mode == "hard":
        Y = _hard_clip(X, float(tau), steps)
    else:
        C = _eye_like(X @ X.mT) + (X @ X.mT) / (tau * tau)
        Y = _inverse_sqrt_spd(C, steps) @ X
    if transposed:
        Y = Y.mT
    return Y.to(M.dtype)
