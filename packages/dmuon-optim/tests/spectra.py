"""Test matrices with a chosen spectrum, built in float64 from random orthonormal factors."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def with_singular_values(
    m: int, n: int, sv: Sequence[float] | torch.Tensor, seed: int = 0
) -> torch.Tensor:
    """``U diag(sv) Vᵀ`` (m × n, float64) with ``U``, ``V`` the Q factors of seeded
    Gaussian matrices: a matrix whose singular values are exactly ``sv`` (min(m, n) of
    them)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return U @ torch.diag(torch.as_tensor(sv, dtype=torch.float64)) @ V.T
