"""The fused normalisation gives the bits of the plain one, for every dtype and orientation.

``_layout.to_wide_normalized`` folds the upcast, the transpose of a tall matrix and the
cast to the compute dtype into its two divisions. The reference below is the plain
sequence of separate passes it replaced (``to``/``contiguous``, ``|G|``, ``amax``, two
divisions, a cast), computed with ordinary torch operators; the results must be equal
bit for bit, since the arithmetic (fp32 or fp64 divisions, one rounding to the compute
dtype) is the same.
"""

from __future__ import annotations

import pytest
import torch

from dmuon.kernels._layout import restore, to_wide_normalized


def plain_reference(G: torch.Tensor, eps: float, compute_dtype: torch.dtype) -> torch.Tensor:
    m, n = G.shape[-2:]
    X = G.reshape(-1, m, n)
    if m > n:
        X = X.mT
    work = torch.float64 if G.dtype == torch.float64 else torch.float32
    X = X.to(work).contiguous()
    scale = X.abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    X = X / scale
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    return X.to(compute_dtype).contiguous()


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(24, 80), (80, 24), (3, 2, 16, 40), (3, 40, 16)], ids=str)
def test_fused_normalisation_equals_the_plain_passes(shape, dtype, compute):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    G[..., 0, 0] = 0.0  # a zero entry and a negative maximum are both exercised
    G[..., 1, 1] = -4.0
    X, layout = to_wide_normalized(G, 1e-7, compute, "standard")
    ref = plain_reference(G, 1e-7, compute)
    assert X.dtype == compute and X.is_contiguous() and X.shape == ref.shape
    assert torch.equal(X, ref)
    assert layout.transposed == (shape[-2] > shape[-1])


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(80, 24), (3, 40, 16)], ids=str)
def test_tall_in_place_normalises_without_a_transposed_copy(shape, dtype, compute):
    # The CPU torch path: X is the wide view of a contiguous tall buffer. Same values as
    # the plain passes to two ulps of the compute dtype (the norm sums the same entries
    # in the tall memory order, so it may round differently).
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    G[..., 1, 1] = -4.0
    X, layout = to_wide_normalized(G, 1e-7, compute, "standard", tall_in_place=True)
    ref = plain_reference(G, 1e-7, compute)
    assert X.dtype == compute and X.shape == ref.shape and layout.transposed
    assert X.mT.is_contiguous() and not X.is_contiguous()
    torch.testing.assert_close(X, ref, rtol=3e-7 if compute == torch.float32 else 8e-3, atol=0)
    out = restore(X, layout)
    assert out.shape == G.shape and out.is_contiguous()


def test_zero_matrices_in_a_batch_stay_zero():
    G = torch.randn(3, 8, 20)
    G[1] = 0.0
    X, _ = to_wide_normalized(G, 1e-7, torch.float32, "gram")
    assert not X[1].any() and torch.isfinite(X).all()
    torch.testing.assert_close(torch.linalg.vector_norm(X[0]), torch.tensor(1.0))


def test_autograd_path_gives_the_same_values_and_a_gradient():
    G = torch.randn(40, 12, dtype=torch.float64, requires_grad=True)
    X, layout = to_wide_normalized(G, 1e-7, torch.float64, "standard")
    assert torch.equal(X.detach(), plain_reference(G.detach(), 1e-7, torch.float64))
    restore(X, layout).sum().backward()
    assert G.grad is not None and torch.isfinite(G.grad).all()


def test_restore_of_the_same_dtype_is_a_view_without_a_copy():
    G = torch.randn(48, 16)  # tall: the wide X comes back as its transpose
    X, layout = to_wide_normalized(G, 1e-7, torch.float32, "standard")
    out = restore(X, layout)
    assert out.shape == G.shape and out.data_ptr() == X.data_ptr()
