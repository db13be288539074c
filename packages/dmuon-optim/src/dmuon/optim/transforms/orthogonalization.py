"""Orthogonalisation of the whole matrix: the step that makes Muon Muon."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, matrix_keys
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["Orthogonalize"]


@dataclass(frozen=True)
class Orthogonalize(Transform):
    """``X ← NS(X) ≈ U Vᵀ`` for ``X = U Σ Vᵀ``, every matrix of the batch in one call.

    Runs :func:`dmuon.kernels.orthogonalize` once on the whole ``(B, m, n)`` batch
    with the group's ``ns_method``, ``ns_coefficients``, ``ns_steps`` and
    ``ns_compute_dtype``; the result comes back in ``X``'s dtype. Sign-Muon's
    optional local polar step is ``Orthogonalize(when_option="local_polar")``
    (see :class:`~dmuon.optim.transforms.Transform`).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import Orthogonalize, StepContext
        >>> hp = dict(ns_method="gram", ns_coefficients="polar_express", ns_steps=5,
        ...           ns_compute_dtype="float32")
        >>> X = torch.randn(3, 8, 16)
        >>> O = Orthogonalize()(X, {}, StepContext(grad=X, hp=hp))
        >>> O.shape
        torch.Size([3, 8, 16])
    """

    hyperparameters: ClassVar[Mapping[str, Option]] = matrix_keys(
        "ns_method", "ns_coefficients", "ns_steps", "ns_compute_dtype"
    )
    splits: ClassVar[bool] = True  # through ctx.orthogonalize: the TP-native Gram path

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        return ctx.orthogonalize(X)
