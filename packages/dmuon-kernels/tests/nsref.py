"""References computed another way than the code under test: a float64 SVD."""

import torch

from dmuon.kernels import ns_scalar_map


def normalised_svd(G: torch.Tensor, eps: float = 1e-7):
    """SVD of G/(‖G‖_F + eps·max|G|) in float64, the input the iterations see."""
    G64 = G.to(torch.float64)
    amax = G64.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    nrm = torch.linalg.vector_norm(G64 / amax, dim=(-2, -1), keepdim=True)
    X = G64 / amax / (nrm + eps)
    return torch.linalg.svd(X, full_matrices=False)


def expected_output(G: torch.Tensor, coefficients, steps: int = 5) -> torch.Tensor:
    """U φ(Σ) Vᵀ: what exact arithmetic Newton–Schulz must return."""
    U, S, Vh = normalised_svd(G)
    return U @ torch.diag_embed(ns_scalar_map(coefficients, S, steps)) @ Vh


def matrix_with_singular_values(m: int, n: int, sv: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Random singular vectors (float64) with prescribed singular values."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return U @ torch.diag(sv.to(torch.float64)) @ V.mT


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))
