"""Musec: clip the singular values of the momentum instead of setting them all to one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.kernels import spectral_clip
from dmuon.optim.hyperparameters import Option, choice, integer, optional, real
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["MomentumSpectralClip"]


@dataclass(frozen=True)
class MomentumSpectralClip(Transform):
    """``X ← clip_τ(B)``, ``B = √min(m, n)·X/‖X‖_F``: hard ``U min(Σ, τ) Vᵀ`` or soft
    ``U Σ(I + Σ²/τ²)^{-1/2} Vᵀ``.

    **A reconstruction.** No text of "Musec" (momentum spectral clipping) could be
    found; its seed text says it "clips singular values of the momentum matrix to
    approximately one, preserving the underlying spectral structure". This follows
    its closest published relatives: MuCon's hard clip of the momentum's singular
    values at τ (A. Yi, arXiv 2605.26459) and SPECTRA's soft clip (Jiang, Semenov,
    Stich, arXiv 2603.14315), both computed without an SVD by
    :func:`dmuon.kernels.spectral_clip`.

    Clipping is not scale-invariant, so the units of τ matter. The momentum is
    first brought to the Frobenius norm of Muon's update — ``‖polar(X)‖_F =
    √min(m, n)`` for a full-rank ``X`` — so its singular values have root-mean-square
    one, as Muon's all equal one:

        B = √min(m, n) · X / ‖X‖_F,        Σ_i σ_i(B)² = min(m, n)

    and then clipped at τ (default 1). A direction stronger than average becomes
    τ (Muon's step there); a weaker one keeps its relative size (the spectral
    structure Muon discards). The update's spectral norm is at most τ and its
    Frobenius norm at most Muon's, whatever the scale of the gradients. In gradient
    units — the previous convention, ``B = (1 − μ)·X`` — the singular values of a
    trained network's momentum sit far below 1, nothing was clipped and the step
    was a momentum-SGD step too small for ``match_rms_adamw``'s learning rates
    (issue 17: validation loss flat over a tenfold range of learning rates). A zero
    momentum gives a zero update.

    The iterations run in fp32 (fp64 for fp64 input) whatever ``ns_compute_dtype``
    says: the sign of ``BBᵀ − τ²I`` needs more precision than bf16 has.

    Hyperparameters: ``clip_mode`` (``"hard"``/``"soft"``), ``clip_tau`` (τ > 0),
    ``clip_steps`` (inner iterations, ``None`` = the kernel's default).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import MomentumSpectralClip, StepContext
        >>> X = 1e-3 * torch.randn(1, 6, 10, dtype=torch.float64)
        >>> hp = dict(clip_mode="hard", clip_tau=1.0, clip_steps=None)
        >>> Y = MomentumSpectralClip()(X, {}, StepContext(grad=X, hp=hp))
        >>> s = torch.linalg.svdvals(Y)
        >>> bool(s.max() < 1.001), bool(s.square().sum() <= 6.0 + 1e-9)
        (True, True)
    """

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "clip_mode": Option("hard", choice(("hard", "soft")), "hard or soft clipping"),
        "clip_tau": Option(1.0, real(0.0, lo_open=True), "clipping level τ"),
        "clip_steps": Option(None, optional(integer(1)), "inner iterations of the clip"),
    }

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        work = torch.float64 if X.dtype == torch.float64 else torch.float32
        k = min(X.shape[-2], X.shape[-1])
        # Divide by the largest entry first: ‖X‖_F of a saturated momentum (entries near
        # the dtype's maximum, see Momentum) would overflow; after it every entry of B
        # is at most √min(m, n), so B Bᵀ fits fp32 for any practical width.
        B = X.to(work)
        amax = B.abs().amax(dim=(-2, -1), keepdim=True)
        B = B / torch.where(amax > 0, amax, torch.ones_like(amax))
        fro = torch.linalg.matrix_norm(B, ord="fro", keepdim=True)
        B = B * (math.sqrt(k) / torch.where(fro > 0, fro, torch.ones_like(fro)))
        return spectral_clip(
            B,
            float(ctx.hp["clip_tau"]),
            mode=ctx.hp["clip_mode"],
            steps=ctx.hp["clip_steps"],
            compute_dtype=work,
        ).to(X.dtype)
