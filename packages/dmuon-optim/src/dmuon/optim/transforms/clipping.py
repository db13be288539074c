"""Musec: clip the singular values of the momentum instead of setting them all to one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.kernels import spectral_clip
from dmuon.optim.hyperparameters import Option, choice, integer, matrix_keys, optional, real
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["MomentumSpectralClip"]

_FP32_SAFE = 2.0**48  # below this ∞-norm, M Mᵀ of any practical width fits fp32


@dataclass(frozen=True)
class MomentumSpectralClip(Transform):
    """``X ← clip_τ((1−μ)·X)``: hard ``U min(Σ, τ) Vᵀ`` or soft ``U Σ(I + Σ²/τ²)^{-1/2} Vᵀ``.

    **A reconstruction.** No text of "Musec" (momentum spectral clipping) could be
    found; this follows its closest published relatives: MuCon's hard clip of the
    momentum's singular values at τ (A. Yi, arXiv 2605.26459) and SPECTRA's soft
    clip (Jiang, Semenov, Stich, arXiv 2603.14315), both computed without an SVD by
    :func:`dmuon.kernels.spectral_clip`. Unlike orthogonalisation, clipping is not
    scale-invariant, so the convention matters: the sum-form momentum is first
    brought to EMA units, ``(1 − μ)·X`` (≈ the gradient's scale), then clipped. A
    singular value far above τ becomes τ (a Muon step of size τ); one below τ
    passes through unchanged (an SGD-with-momentum step).

    The iterations run in fp32 (fp64 for fp64 input) whatever ``ns_compute_dtype``
    says: the sign of ``MMᵀ − τ²I`` needs more precision than bf16 has.

    Hyperparameters: ``clip_mode`` (``"hard"``/``"soft"``), ``clip_tau`` (τ > 0),
    ``clip_steps`` (inner iterations, ``None`` = the kernel's default), ``momentum``.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import MomentumSpectralClip, StepContext
        >>> X = 10 * torch.randn(1, 6, 10, dtype=torch.float64)
        >>> hp = dict(clip_mode="hard", clip_tau=1.0, clip_steps=None, momentum=0.0)
        >>> Y = MomentumSpectralClip()(X, {}, StepContext(grad=X, hp=hp))
        >>> bool(torch.linalg.svdvals(Y).max() < 1.001)
        True
    """

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "clip_mode": Option("hard", choice(("hard", "soft")), "hard or soft clipping"),
        "clip_tau": Option(1.0, real(0.0, lo_open=True), "clipping level τ"),
        "clip_steps": Option(None, optional(integer(1)), "inner iterations of the clip"),
        **matrix_keys("momentum"),
    }

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        mu = float(ctx.hp["momentum"])
        work = torch.float64 if X.dtype == torch.float64 else torch.float32
        Y = X * (1.0 - mu)
        # M Mᵀ overflows fp32 for entries beyond ~2⁶⁴ (a saturated momentum, see
        # Momentum): such a step clips in fp64, whose range holds σ² (the result, of
        # spectral norm ≤ τ, fits any dtype). Ordinary momenta stay far below 2⁴⁸.
        if work is torch.float32 and not bool(Y.abs().amax() < _FP32_SAFE):
            work = torch.float64
        return spectral_clip(
            Y,
            float(ctx.hp["clip_tau"]),
            mode=ctx.hp["clip_mode"],
            steps=ctx.hp["clip_steps"],
            compute_dtype=work,
        )
