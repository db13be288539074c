"""MONA's acceleration term: an EMA of gradient differences added before NS."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, matrix_keys, real
from dmuon.optim.transforms.base import StateSpec, StepContext, Transform
from dmuon.optim.transforms.momentum import saturate_

__all__ = ["GradDiffAcceleration"]


@dataclass(frozen=True)
class GradDiffAcceleration(Transform):
    """``D ← β_d·D + (1−β_d)(G_t − G_{t−1})``, ``X ← X + γ/(1−μ)·D``.

    **A reconstruction.** MONA (Li et al., "Muon Optimizer with Nesterov
    Acceleration", arXiv 2605.26842) is available only as an abstract: it adds an
    acceleration term computed as an EMA of gradient differences into Muon's
    pipeline before orthogonalisation. We use the Adan form of that term (Xie et al.,
    arXiv 2208.06677): in EMA units Adan's direction is ``m + γ·D`` with ``m`` the
    EMA of gradients. DMuon's momentum is in sum form, ``M ≈ m/(1 − μ)``, so the term
    is scaled by ``1/(1 − μ)`` to keep ``γ`` in the EMA units of the papers. On the
    first step there is no previous gradient: ``G_0 := G_1`` and ``D`` stays 0.

    Hyperparameters: ``mona_beta`` (β_d), ``mona_gamma`` (γ), ``momentum`` (μ).
    State: ``prev_grad``, ``grad_diff_avg`` (both ``matrix``).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import GradDiffAcceleration, StepContext
        >>> st = {"prev_grad": torch.zeros(1, 1, 1), "grad_diff_avg": torch.zeros(1, 1, 1)}
        >>> hp = {"mona_beta": 0.5, "mona_gamma": 1.0, "momentum": 0.0}
        >>> G1, G2 = torch.ones(1, 1, 1), torch.full((1, 1, 1), 3.0)
        >>> GradDiffAcceleration()(G1, st, StepContext(grad=G1, hp=hp, step=1)).item()
        1.0
        >>> GradDiffAcceleration()(G2, st, StepContext(grad=G2, hp=hp, step=2)).item()  # 3 + 0.5*2
        4.0
    """

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec("prev_grad", "matrix"), StateSpec("grad_diff_avg", "matrix"))

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "mona_beta": Option(
            0.92, real(0.0, 1.0, hi_open=True), "EMA decay of gradient differences"
        ),
        "mona_gamma": Option(0.92, real(0.0), "weight of the acceleration term"),
        **matrix_keys("momentum"),
    }
    splits: ClassVar[bool] = True  # elementwise

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        beta = float(ctx.hp["mona_beta"])
        gamma = float(ctx.hp["mona_gamma"])
        mu = float(ctx.hp["momentum"])
        G = ctx.grad
        prev, D = state["prev_grad"], state["grad_diff_avg"]
        if ctx.step <= 1:
            prev.copy_(G)
        # saturated, as the momentum is (momentum.saturate_): a difference or a sum of
        # finite values past the dtype's range is ±max, not ±inf (NaN in Newton–Schulz)
        saturate_(D.mul_(beta).add_(saturate_(G - prev), alpha=1.0 - beta))
        prev.copy_(G)
        return saturate_(X.add(D, alpha=gamma / (1.0 - mu)))
