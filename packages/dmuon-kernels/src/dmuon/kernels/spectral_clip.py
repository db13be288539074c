"""Clipping the singular values of a matrix without an SVD.

Hard clip, ``U min(Σ, τ) Vᵀ`` — the Frobenius projection onto the spectral-norm
ball of radius τ (MuCon, arXiv 2605.26459; F. Cesista, "Spectral clipping",
2025). Everything is done on the small side: with ``A = M Mᵀ`` (wide orientation,
``m × m``, ``A = U Σ² Uᵀ``), the matrix

    B = max(A, τ²I) = (A + τ²I + |A − τ²I|) / 2,     |S| = S·sign(S),

has the eigenvectors of ``A`` and the eigenvalues ``max(σ_i², τ²)``, so

    τ B^{-1/2} M = U [τ σ_i / max(σ_i, τ)] Vᵀ = U min(Σ, τ) Vᵀ = clip_τ(M).

(Proof: ``B^{-1/2} M = U diag(max(σ_i, τ)^{-1}) Uᵀ U Σ Vᵀ``; ``τσ/max(σ, τ)`` is σ for
σ ≤ τ and τ for σ ≥ τ.) ``sign(A − τ²I)`` is the polar factor of a symmetric matrix,
computed by Newton–Schulz on the ``m × m`` matrix; ``B^{-1/2}`` by the coupled
Newton–Schulz iteration (Higham, *Functions of Matrices*, §6.3, eq. 6.35), which
converges fast because ``B``'s eigenvalues lie in ``[τ², σ_max²]``. The only
``m × n`` products are ``A = M Mᵀ`` and ``B^{-1/2}·M``. When the sign is inexact —
only for σ close to τ — the eigenvalue of ``B`` lies between σ² and τ² and that
singular value is mapped to a value between σ and τ.

Soft clip, ``U [σ / √(1 + σ²/τ²)] Vᵀ = (I + M Mᵀ/τ²)^{-1/2} M`` — the SPECTRA soft
clip (Jiang, Semenov, Stich, arXiv 2603.14315), with the same coupled iteration.
"""

from __future__ import annotations

import math

import torch

from dmuon.kernels._layout import check_matrix_input, empty_result
from dmuon.kernels.coefficients import MAX_STEPS
from dmuon.kernels.orthogonalize import orthogonalize

__all__ = ["spectral_clip"]


def _eye_like(A: torch.Tensor) -> torch.Tensor:
    return torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)


def _spectral_bound(A: torch.Tensor) -> torch.Tensor:
    """An upper bound of ``‖A‖₂`` for symmetric ``A``, shape ``(..., 1, 1)``: the smaller of
    ``‖A‖_F`` and the largest absolute row sum (Gershgorin). Both are O(m²)."""
    fro = torch.linalg.matrix_norm(A, ord="fro", keepdim=True)
    rows = A.abs().sum(dim=-1, keepdim=True).amax(dim=-2, keepdim=True)
    return torch.minimum(fro, rows)


def _inverse_sqrt_steps(kappa: float) -> int:
    """Coupled Newton–Schulz steps for ``C/s`` with eigenvalues in ``[1/κ, 1]``.

    In the eigenbasis ``t = λ z²`` follows ``t ← t (3 − t)²/4``: ×2.25 while ``t`` is
    small, then quadratic; ``⌈log_{2.25} κ⌉ + 6`` steps bring every ``t`` to within
    1e-15 of 1 (checked for κ from 1 to 1e12).
    """
    return math.ceil(math.log(max(kappa, 1.0)) / math.log(2.25)) + 6


def _hard_clip(M: torch.Tensor, tau: torch.Tensor, steps: int) -> torch.Tensor:
    A = M @ M.mT
    I = _eye_like(A)
    S = A - (tau * tau) * I
    sign = orthogonalize(
        S, method="standard", coefficients="polar_express_raw", steps=steps, compute_dtype=M.dtype
    )
    absS = S @ sign
    # S and sign(S) commute, so |S| = S·sign(S) is symmetric; keep it so in rounding.
    B = 0.5 * (A + (tau * tau) * I + 0.5 * (absS + absS.mT))
    # ‖B‖₂ = max(‖A‖₂, τ²) (between them where the sign is inexact); 5% of room keeps
    # every eigenvalue of B/s below 1, inside the iteration's (0, 2) convergence interval.
    s = 1.05 * torch.clamp_min(_spectral_bound(A), tau * tau)
    kappa = float((s / (tau * tau)).amax())
    if not math.isfinite(kappa):
        raise ValueError(
            f"spectral_clip: σ_max²/τ² of M is beyond {M.dtype}'s range (σ_max/τ above "
            f"about {math.sqrt(torch.finfo(M.dtype).max):.1e}, or M holds inf/NaN); pass "
            "compute_dtype=torch.float64, or a tau nearer M's spectral norm"
        )
    inner = _inverse_sqrt_steps(kappa)
    return tau * (_inverse_sqrt_spd(B, inner, s) @ M)


def _inverse_sqrt_spd(C: torch.Tensor, steps: int, s: torch.Tensor | None = None) -> torch.Tensor:
    """Coupled Newton–Schulz: ``Y → (C/s)^{1/2}``, ``Z → (C/s)^{-1/2}`` with ``s ≥ ‖C‖₂``
    (``‖C‖_F`` unless given); returns ``Z/√s = C^{-1/2}``."""
    if s is None:
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
    Both use only matrix products (Newton–Schulz-type iterations) and work on the
    ``m × m`` Gram side (wide orientation): two ``m × n`` products per call, the rest
    ``m × m``. An SVD is used only by the tests, as the reference.

    Accuracy: hard clipping resolves singular values whose distance to τ, relative
    to ``‖MMᵀ − τ²I‖_F``, is above about 1e-4 with the default 12 steps; closer ones
    are mapped to a value between σ and τ. Soft clipping needs about
    ``log₂(1 + σ_max²/τ²) + 6`` steps (default 30).

    Args:
        M: ``(..., m, n)`` real floating tensor.
        tau: the clipping level, > 0.
        mode: ``"hard"`` or ``"soft"``.
        steps: hard: Newton–Schulz steps of the sign of ``MMᵀ − τ²I`` (default 12; the
            inverse square root of ``B`` takes ``⌈log_{2.25}(σ_max²/τ²)⌉ + 6`` steps,
            from a bound on ``σ_max``, which needs one host synchronisation); soft:
            steps of the inverse square root (default 30). At most
            :data:`~dmuon.kernels.coefficients.MAX_STEPS`.
        compute_dtype: dtype of the iterations; fp32 by default because the sign of
            ``MMᵀ − τ²I`` needs more precision than an orthogonalised update (bf16's
            8 bits cannot tell an eigenvalue of ``A`` within 0.4% of ``‖A‖`` from τ²).
            The inverse square root stays in it too: its coupled iteration is stable but
            not self-correcting, so a bf16 phase followed by fp32 steps restarted from
            its result keeps the bf16 error (1e-3 to 3e-2 relative, measured).

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
    if tau == float("inf"):  # nothing to clip
        return M.clone()
    if steps is None:
        steps = 12 if mode == "hard" else 30
    elif isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        # the soft clip's loop has no bound of its own: steps=10**9 iterated for ever
        raise ValueError(
            f"steps must be an integer from 1 to {MAX_STEPS} "
            f"(dmuon.kernels.coefficients.MAX_STEPS; the default is 12 hard, 30 soft), "
            f"got {steps!r}"
        )
    if M.numel() == 0:
        return empty_result(M)
    transposed = M.shape[-2] > M.shape[-1]
    X = (M.mT if transposed else M).to(compute_dtype)
    # Clipping is homogeneous, clip_τ(M) = 2ᵉ clip_{τ/2ᵉ}(M/2ᵉ): each matrix is scaled by
    # a power of two (exact) to entries below 1, so that M Mᵀ and τ² neither overflow
    # nor underflow; τ/2ᵉ is kept within 2^±40 (a σ/τ ratio beyond that is not
    # representable in fp32's M Mᵀ either way).
    _, e = torch.frexp(X.detach().abs().amax(dim=(-2, -1), keepdim=True))
    e = e.clamp(math.ceil(math.log2(tau)) - 40, math.floor(math.log2(tau)) + 40)
    X = torch.ldexp(X, -e)
    t = torch.ldexp(torch.full_like(e, float(tau), dtype=X.dtype), -e)
    if mode == "hard":
        Y = _hard_clip(X, t, steps)
    else:
        A = X @ X.mT  # once: it is one of the two m × n products
        Y = _inverse_sqrt_spd(_eye_like(A) + A / (t * t), steps) @ X
    Y = torch.ldexp(Y, e)
    if transposed:
        Y = Y.mT
    return Y.to(M.dtype)
