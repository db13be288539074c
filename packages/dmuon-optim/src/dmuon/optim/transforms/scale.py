"""The learning-rate convention as the last link of a chain."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dmuon.optim.scaling import adjust_lr_factor
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["AdjustLR"]


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

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        m, n = X.shape[-2], X.shape[-1]
        ctx.scale *= adjust_lr_factor(ctx.hp["adjust_lr"], m, n)
        return X
