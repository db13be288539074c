"""Musec: clip the singular values of the momentum instead of setting them all to one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.kernels import spectral_clip
from dmuon.optim.hyperparameters import (
    NS_STEPS_MAX,
    Option,
    choice,
    integer,
    optional,
    real,
)
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["MomentumSpectralClip"]


TAU_MIN = 1e-6
"""The smallest ``clip_tau``: every direction above a millionth of the RMS singular value
is clipped (Muon's step), and ``σ_max(B)²/τ²`` of :func:`~dmuon.kernels.spectral_clip`
stays within fp32's range for any width (a smaller τ made every step raise there, after
the momentum had absorbed the gradient)."""


@dataclass(frozen=True)
class MomentumSpectralClip(Transform):
    """``X ← clip(B)``, ``B = √min(m, n)·X/(τ‖X‖_F)``: hard ``U min(Σ, 1) Vᵀ`` or soft
    ``U Σ(I + Σ²)^{-1/2} Vᵀ``.

    **A reconstruction.** No text of "Musec" (momentum spectral clipping) could be
    found; its seed text says it "clips singular values of the momentum matrix to
    approximately one, preserving the underlying spectral structure". This follows
    its closest published relatives: MuCon's hard clip of the momentum's singular
    values (A. Yi, arXiv 2605.26459) and SPECTRA's soft clip (Jiang, Semenov, Stich,
    arXiv 2603.14315), both computed without an SVD by
    :func:`dmuon.kernels.spectral_clip`.

    Clipping is not scale-invariant, so the units matter. The momentum is brought to
    Muon's Frobenius norm — ``‖polar(X)‖_F = √min(m, n)`` for a full-rank ``X`` — so
    its singular values have root-mean-square one, as Muon's all equal one; τ says
    where, relative to that RMS, clipping starts, and the result is clipped at one:

        B = √min(m, n) · X / (τ ‖X‖_F),        (1/k) Σ_i σ_i(B)² = 1/τ²

    A direction whose singular value is above τ times the RMS becomes one (Muon's
    step there); a weaker one keeps its relative size (the spectral structure Muon
    discards). The update's spectral norm is at most one and its Frobenius norm at
    most Muon's, whatever the scale of the gradients, so Muon's learning rates carry
    over — up to the hard clip's inexactness near the level: with the default 12 inner
    steps a singular value just above τ·RMS comes out between its own value and one
    (256 × 256 Gaussian momentum: spectral norm 1.0000 at τ = 0.1, 1.016 at 0.03, 1.09
    at 0.01, 1.33 at 0.001; ``clip_steps=16`` brings 0.03 and 0.01 to 1.000 and 24 brings
    0.001 to 1.004; rectangular matrices, whose spectrum stays away from zero, are
    exact at 12). τ = 0.1 (the default) clips every direction above a tenth of the
    RMS: on the learning-rate grid of ``benchmarks/lr_grid.py`` it matches Muon
    (within the seeds' spread), where τ = 1 (MuCon's level in these units) trailed
    Muon by 0.17 in validation loss (the τ × lr grid on the Musec page). Dividing by τ before the
    clip at one is the clip at τ scaled by 1/τ: ``clip_1(B/τ) = clip_τ(B)/τ``.
    A zero momentum gives a zero update.

    The iterations run in fp32 (fp64 for fp64 input) whatever ``ns_compute_dtype``
    says: the sign of ``BBᵀ − I`` needs more precision than bf16 has.

    Hyperparameters: ``clip_mode`` (``"hard"``/``"soft"``), ``clip_tau`` (τ > 0, the
    clip level as a fraction of the momentum's RMS singular value), ``clip_steps``
    (inner iterations, ``None`` = the kernel's default).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import MomentumSpectralClip, StepContext
        >>> X = 1e-3 * torch.randn(1, 6, 10, dtype=torch.float64)
        >>> hp = dict(clip_mode="hard", clip_tau=0.5, clip_steps=None)
        >>> Y = MomentumSpectralClip()(X, {}, StepContext(grad=X, hp=hp))
        >>> s = torch.linalg.svdvals(Y)
        >>> bool(s.max() < 1.001), bool(s.square().sum() <= 6.0 + 1e-9)
        (True, True)
    """

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "clip_mode": Option("hard", choice(("hard", "soft")), "hard or soft clipping"),
        "clip_tau": Option(
            0.1,
            real(TAU_MIN),
            "clip level τ, a fraction of the RMS singular value (below 1e-6 every "
            "direction is clipped: Muon's step)",
        ),
        "clip_steps": Option(
            None,
            optional(integer(1, NS_STEPS_MAX)),
            f"inner iterations of the clip, 1 to {NS_STEPS_MAX}",
        ),
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
        tau = float(ctx.hp["clip_tau"])
        B = B * (math.sqrt(k) / tau / torch.where(fro > 0, fro, torch.ones_like(fro)))
        return spectral_clip(
            B,
            1.0,
            mode=ctx.hp["clip_mode"],
            steps=ctx.hp["clip_steps"],
            compute_dtype=work,
        ).to(X.dtype)
