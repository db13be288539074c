"""The exact polar factor, for tests and research."""

from __future__ import annotations

import torch

from dmuon.kernels._layout import check_matrix_input

__all__ = ["polar_factor"]


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """``U Vᵀ`` from a float64 SVD ``G = U Σ Vᵀ`` (thin), for a matrix or a batch.

    This is the reference every Newton–Schulz path is tested against. It returns
    float64 regardless of the input dtype. Zero singular values make the polar
    factor non-unique; the SVD's choice of vectors is returned.

    Examples:
        >>> import torch
        >>> P = polar_factor(torch.randn(4, 6))
        >>> torch.allclose(P @ P.mT, torch.eye(4, dtype=torch.float64))
        True
    """
    check_matrix_input(G)
    U, _, Vh = torch.linalg.svd(G.to(torch.float64), full_matrices=False)
    return U @ Vh
