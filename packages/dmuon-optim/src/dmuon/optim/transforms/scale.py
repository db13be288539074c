"""The size of the step as the last link of a chain: a convention or a norm ball's radius."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, matrix_keys, real
from dmuon.optim.scaling import adjust_lr_factor
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["AdjustLR", "SpectralRadius"]


@dataclass(frozen=True)
class AdjustLR(Transform):
    """Multiply the step's scale by the ``adjust_lr`` factor of the matrix shape ``m × n``.

    The tensor passes through unchanged; the factor ends up in
    :attr:`StepContext.scale` and is folded into the learning rate by the apply
    step (see :mod:`dmuon.optim.scaling` for the conventions).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import AdjustLR, StepContext
        >>> X = torch.zeros(2, 100, 400)
        >>> ctx = StepContext(grad=X, hp={"adjust_lr": "match_rms_adamw"})
        >>> _ = AdjustLR()(X, {}, ctx)
        >>> ctx.scale
        4.0
    """

    hyperparameters: ClassVar[Mapping[str, Option]] = matrix_keys("adjust_lr")
    splits: ClassVar[bool] = True  # the whole matrix's shape, from ctx.matrix_shape

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        m, n = ctx.matrix_shape
        ctx.scale *= adjust_lr_factor(ctx.hp["adjust_lr"], m, n)
        return X


@dataclass(frozen=True)
class SpectralRadius(Transform):
    """Multiply the step's scale by ``ρ·√(m/n)``: the radius of a spectral-norm ball.

    With ``X`` the polar factor ``UVᵀ`` of the momentum, ``−ρ·√(m/n)·UVᵀ`` is the
    linear minimisation oracle of the ball ``{W : ‖W‖_{RMS→RMS} ≤ ρ}`` of an
    ``m × n`` hidden matrix (``m`` fan-out, ``n`` fan-in; ``‖W‖_{RMS→RMS} =
    √(n/m)·‖W‖₂``): Pethick et al., *Training Deep Learning Models with
    Norm-Constrained LMOs* (Scion), arXiv 2502.07529, §3 and Table 2. Reads the
    group's ``radius`` (ρ); ``adjust_lr`` is not used.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import SpectralRadius, StepContext
        >>> X = torch.zeros(1, 400, 100)
        >>> ctx = StepContext(grad=X, hp={"radius": 3.0})
        >>> _ = SpectralRadius()(X, {}, ctx)
        >>> ctx.scale
        6.0
    """

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "radius": Option(1.0, real(0.0, lo_open=True), "ρ, the spectral ball's radius"),
    }
    splits: ClassVar[bool] = True  # the whole matrix's shape, from ctx.matrix_shape

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        m, n = ctx.matrix_shape
        # √(m/n) is the "spectral" convention's factor: one definition of it
        ctx.scale *= float(ctx.hp["radius"]) * adjust_lr_factor("spectral", m, n)
        return X
