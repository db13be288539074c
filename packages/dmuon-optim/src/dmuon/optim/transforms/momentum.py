"""Heavy-ball momentum in sum form, with optional Nesterov look-ahead."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, matrix_keys
from dmuon.optim.transforms.base import StateSpec, StepContext, Transform

__all__ = ["Momentum"]


@dataclass(frozen=True)
class Momentum(Transform):
    """``M ← μ·M + G``; output ``G + μ·M`` (Nesterov) or ``M``.

    This is the *sum form* of Moonlight (Liu et al., arXiv 2502.16982), DMuon's
    release and microsoft/dion. Keller Jordan's Muon and ``torch.optim.Muon``'s
    code keep an EMA instead, ``E ← μ·E + (1 − μ)·G`` with Nesterov input
    ``(1 − μ)·G + μ·E``. From a zero start ``E = (1 − μ)·M`` at every step, so both
    outputs differ by the constant factor ``1 − μ``, which the Frobenius
    normalisation in front of Newton–Schulz removes: every rule whose next step is
    scale-invariant (orthogonalisation, sign) gives the same update under either
    form. Rules that use the momentum's magnitude say how on their page.

    Hyperparameters: ``momentum`` (μ ∈ [0, 1)), ``nesterov`` (bool).
    State: ``momentum_buffer`` (``matrix``), zero at the start.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import Momentum, StepContext
        >>> G = torch.ones(1, 2, 2)
        >>> state = {"momentum_buffer": torch.zeros(1, 2, 2)}
        >>> ctx = StepContext(grad=G, hp={"momentum": 0.5, "nesterov": True})
        >>> Momentum()(G, state, ctx)[0, 0, 0].item()  # G + 0.5 * (0.5 * 0 + G)
        1.5
    """

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec("momentum_buffer", "matrix"),)

    hyperparameters: ClassVar[Mapping[str, Option]] = matrix_keys("momentum", "nesterov")

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        mu = float(ctx.hp["momentum"])
        M = state["momentum_buffer"]
        torch.add(X, M, alpha=mu, out=M)  # one pass: M ← G + μM
        if ctx.hp["nesterov"]:
            return X.add(M, alpha=mu)
        return M
