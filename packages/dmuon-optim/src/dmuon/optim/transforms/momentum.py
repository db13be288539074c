"""Heavy-ball momentum in sum form (saturating, never ±inf), with optional Nesterov look-ahead."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, matrix_keys
from dmuon.optim.transforms.base import StateSpec, StepContext, Transform

__all__ = ["Momentum", "saturate_"]


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
    form (``torch.optim.Muon``'s normalisation has an absolute floor of 1e-7 on the
    norm, DMuon's guard is relative: below that floor torch's update shrinks). Rules
    that use the momentum's magnitude say how on their page.

    **Saturation.** The sum form grows to ``|G|/(1 − μ)``: twenty times the gradient
    at μ = 0.95, so a finite gradient of 1e38 overflowed fp32 (max 3.4e38) by step 3
    and every weight became NaN, past the ``nonfinite=`` guard, which saw a finite
    gradient. The buffer and the Nesterov output are therefore clamped to the
    largest finite value ``F`` of their dtype:

        M ← clamp(μ·M + G, −F, F),   output clamp(G + μ·M, −F, F) (Nesterov) or M.

    A clamp changes nothing that did not overflow (bit for bit: every finite result
    is left as it was), so results, state dicts, checkpoints and the parity with
    ``torch.optim.Muon`` are those of the plain sum form; only a momentum that the
    dtype cannot hold saturates at ``±F`` instead of becoming ``±inf`` (and NaN one
    step later, in ``∞ − ∞`` or ``0·∞``). The EMA form would stay finite by itself,
    but it weighs gradients differently when μ changes between steps (a momentum
    warm-up) and would change every saved ``momentum_buffer`` by the factor ``1 − μ``.
    The transforms after it accept such entries: the normalisation in front of
    Newton–Schulz, the subspace iteration and the spectral clip are overflow-safe.

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
    splits: ClassVar[bool] = True  # elementwise

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        mu = float(ctx.hp["momentum"])
        M = state["momentum_buffer"]
        torch.add(X, M, alpha=mu, out=M)  # one pass: M ← G + μM
        saturate_(M)
        if ctx.hp["nesterov"]:
            return saturate_(X.add(M, alpha=mu))
        return M


def saturate_(X: torch.Tensor) -> torch.Tensor:
    """Clamp ``X`` in place to ``±`` the largest finite value of its dtype; return it.

    An entry that overflowed to ``±inf`` becomes ``±max``; every finite entry is left
    bit for bit as it was, and NaN stays NaN (the ``nonfinite=`` guard's business).

    Examples:
        >>> import torch
        >>> saturate_(torch.tensor([float("inf"), -float("inf"), 1.5])).tolist()
        [3.4028234663852886e+38, -3.4028234663852886e+38, 1.5]
    """
    big = torch.finfo(X.dtype).max
    return X.clamp_(-big, big)
