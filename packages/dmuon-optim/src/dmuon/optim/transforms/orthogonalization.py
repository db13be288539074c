"""Orthogonalisation of the whole matrix: the step that makes Muon Muon."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dmuon.optim.transforms.base import StateSpec, StepContext

__all__ = ["Orthogonalize"]


@dataclass(frozen=True)
class Orthogonalize:
    """``X ← NS(X) ≈ U Vᵀ`` for ``X = U Σ Vᵀ``, every matrix of the batch in one call.

    Runs :func:`dmuon.kernels.orthogonalize` once on the whole ``(B, m, n)`` batch
    with the group's ``ns_method``, ``ns_coefficients``, ``ns_steps`` and
    ``ns_compute_dtype``; the result comes back in ``X``'s dtype. With
    ``when_option`` set, the transform runs only when that boolean hyperparameter
    is true (Sign-Muon's optional local polar step).

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

    when_option: str | None = None

    def state_specs(self) -> tuple[StateSpec, ...]:
        return ()

    def __call__(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        if self.when_option is not None and not ctx.hp[self.when_option]:
            return X
        return ctx.orthogonalize(X)
