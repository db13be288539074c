"""The whole orthogonalisation with the Triton kernels equals the torch path.

Under the interpreter (CPU) and compiled (GPU check). Both paths run the same
iteration with the same compute dtype; they differ only in how the symmetric
products are summed and rounded (Triton: fp32 accumulation over 64-wide tiles,
one rounding, exact symmetry), so the tolerances are rounding tolerances of
five compounded steps, stated per dtype below.
"""

import pytest
import torch
from nsref import expected_output, rel_err
from tritonref import DEVICE

pytest.importorskip("dmuon.kernels.triton")
from dmuon.kernels import gram_newton_schulz, newton_schulz, orthogonalize

# Relative Frobenius difference triton vs torch. fp32: unit roundoff 6e-8 times
# k ≈ 200 accumulations times the growth of 5 steps stays below 2e-5 (measured 3e-6).
# fp16: u = 4.9e-4 per rounding, compounded over ~25 products: 1e-2 (measured 1.5e-3).
# bf16: u = 3.9e-3, the Gram iteration compounds to ~3e-2 (the same 6e-2 bound the
# torch path's own Gram-vs-standard test uses).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}

SHAPES = [
    (2, 72, 160),  # batch of wide matrices, two tiles per side of the Gram matrix
    (160, 72),  # tall: transposed to the wide orientation and back
    (100, 100),  # square: Gram falls back to the standard iteration
    (40, 100),  # smaller than one tile
]


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_equals_torch_in_fp32_and_matches_the_svd_reference(method, shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    G = G.to(DEVICE)
    kw = dict(method=method, compute_dtype=torch.float32)
    triton_out = orthogonalize(G, backend="triton", **kw)
    torch_out = orthogonalize(G, backend="torch", **kw)
    assert triton_out.shape == G.shape and triton_out.dtype == G.dtype
    assert rel_err(triton_out.cpu(), torch_out.cpu()) < TOLERANCE[torch.float32]
    # and both are what exact arithmetic gives, to fp32 rounding
    assert rel_err(triton_out.cpu(), expected_output(G.cpu(), "polar_express")) < 1e-4


@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(2, 72, 160), (160, 72)], ids=str)
def test_triton_equals_torch_in_half_precision(method, compute_dtype, shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    kw = dict(method=method, compute_dtype=compute_dtype)
    a = orthogonalize(G, backend="triton", **kw)
    b = orthogonalize(G, backend="torch", **kw)
    assert rel_err(a.cpu(), b.cpu()) < TOLERANCE[compute_dtype]


def test_entry_points_accept_the_backend():
    G = torch.randn(72, 150, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    kw = dict(compute_dtype=torch.float32, backend="triton")
    torch.testing.assert_close(
        newton_schulz(G, **kw), orthogonalize(G, method="standard", **kw), rtol=0, atol=0
    )
    torch.testing.assert_close(
        gram_newton_schulz(G, restarts=(1, 3), **kw),
        orthogonalize(G, method="gram", restarts=(1, 3), **kw),
        rtol=0,
        atol=0,
    )


def test_zero_matrix_gives_zeros_with_triton():
    O = orthogonalize(torch.zeros(2, 72, 100, device=DEVICE), backend="triton")
    assert torch.equal(O, torch.zeros_like(O))


def test_float64_compute_is_refused_with_triton():
    with pytest.raises(
        ValueError, match=r"backend='triton' computes in float16, bfloat16 or float32"
    ):
        orthogonalize(
            torch.randn(8, 16, device=DEVICE), backend="triton", compute_dtype=torch.float64
        )
