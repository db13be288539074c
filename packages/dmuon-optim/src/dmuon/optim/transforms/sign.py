"""Elementwise signs and the majority vote over ranks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["MajorityVote", "Sign"]


@dataclass(frozen=True)
class Sign(Transform):
    """``X ← sign(X)`` entrywise, with ``sign(0) = 0`` (a zero gradient never moves a weight).

    AdaMuon's optional sign step is ``Sign(when_option="sign")`` (see
    :class:`~dmuon.optim.transforms.Transform`).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import Sign, StepContext
        >>> X = torch.tensor([[[-2.0, 0.0, 3.0]]])
        >>> Sign()(X, {}, StepContext(grad=X, hp={})).tolist()
        [[[-1.0, 0.0, 1.0]]]
    """

    splits: ClassVar[bool] = True  # elementwise

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        return torch.sign(X)


@dataclass(frozen=True)
class MajorityVote(Transform):
    """``S ← vote(S)``: the elementwise majority sign over ranks (identity on one process).

    The vote is whatever :class:`~dmuon.optim.SignVote` the step was given
    (:attr:`StepContext.vote`); the transform only checks that it kept the shape.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import MajorityVote, StepContext
        >>> S = torch.tensor([[[1.0, -1.0]]])
        >>> MajorityVote()(S, {}, StepContext(grad=S, hp={})).tolist()
        [[[1.0, -1.0]]]
    """

    collective = True

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        voted = ctx.vote(X)
        if voted.shape != X.shape:
            raise ValueError(
                f"the sign vote returned shape {tuple(voted.shape)} for signs of shape "
                f"{tuple(X.shape)}; a SignVote must keep the shape"
            )
        return voted
