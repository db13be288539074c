"""syrk, sym_poly and sym_mul (Triton) against float64 references computed in torch.

The kernels run in Triton's interpreter on the CPU (conftest.py sets
TRITON_INTERPRET=1 before they are defined) and compiled on CUDA in the GPU check.
Each result is held to the bound its arithmetic allows: the exact float64 value of
the same rounded inputs, within one ulp of the output dtype plus the fp32
accumulation error γ_k·Σ|a||b| (see tritonref.py). Shapes cover square,
rectangular, batched, one-partial-tile and several-partial-tile cases for the
interpreter's 64-wide tiles.
"""

import pytest
import torch
from tritonref import DEVICE, assert_within_one_ulp_of_fp32_accumulation

triton_kernels = pytest.importorskip("dmuon.kernels.triton")
from dmuon.kernels import sym_mul_torch, sym_poly_torch, syrk_torch  # noqa: E402
from dmuon.kernels.triton import sym_mul, sym_poly, syrk  # noqa: E402
from dmuon.kernels.triton.symmetric_matmul import lower_tile_count  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (batch or None for a plain matrix, m, k)
SYRK_SHAPES = [
    (None, 128, 128),  # square, a multiple of the tile: 2×2 tiles, 3 computed
    (None, 72, 200),  # rectangular, partial tiles in both m and k
    (3, 100, 40),  # batched, m > k
    (2, 130, 70),  # three tiles per side, the last one partial
    (1, 5, 3),  # far below one tile
]
SQUARE_SHAPES = [(None, 72), (3, 100), (2, 130), (1, 64)]


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def shape_id(shape):
    return "x".join("" if s is None else str(s) for s in shape).strip("x")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def symmetric(batch, m, dtype, seed=0):
    """A symmetric matrix with eigenvalues in [0, 1] like a Gram matrix, rounded to dtype."""
    shape = (m, 3 * m) if batch is None else (batch, m, 3 * m)
    X = torch.randn(shape, generator=gen(seed), dtype=torch.float64)
    R = X @ X.mT
    R = R / torch.linalg.matrix_norm(R, ord=2, keepdim=True)
    return R.to(dtype).to(DEVICE)  # elementwise rounding keeps it exactly symmetric


def ones(*shape, **kw):
    return torch.ones(*shape, device=DEVICE, **kw)


def empty(*shape, **kw):
    return torch.empty(*shape, device=DEVICE, **kw)


def mirrored_lower(C):
    """The symmetric matrix with C's lower triangle: what the kernels are defined to return."""
    lower = torch.tril(C)
    return lower + torch.tril(C, -1).mT


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SYRK_SHAPES, ids=shape_id)
def test_syrk_equals_float64_x_xt(shape, dtype):
    batch, m, k = shape
    full = (m, k) if batch is None else (batch, m, k)
    X = torch.randn(full, generator=gen(m * k)).to(dtype).to(DEVICE)
    C = syrk(X)
    assert C.shape == (*full[:-1], m) and C.dtype == dtype
    X64 = X.cpu().to(torch.float64)
    exact = X64 @ X64.mT
    assert_within_one_ulp_of_fp32_accumulation(C.cpu(), exact, X64.abs() @ X64.abs().mT, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("a", [0.0, 3.4445], ids=["no_identity", "plus_aI"])
@pytest.mark.parametrize("shape", SQUARE_SHAPES, ids=shape_id)
def test_sym_poly_equals_float64_polynomial(shape, a, dtype):
    batch, m = shape
    b, c = -4.7750, 2.0315
    A = symmetric(batch, m, dtype, seed=m)
    Z = sym_poly(A, b, c, a)
    assert Z.shape == A.shape and Z.dtype == dtype
    A64 = A.cpu().to(torch.float64)
    eye = torch.eye(m, dtype=torch.float64)
    exact = b * A64 + c * (A64 @ A64) + a * eye
    magnitude = abs(c) * (A64.abs() @ A64.abs()) + abs(b) * A64.abs() + abs(a) * eye
    assert_within_one_ulp_of_fp32_accumulation(Z.cpu(), exact, magnitude, m)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SQUARE_SHAPES, ids=shape_id)
def test_sym_mul_equals_mirrored_lower_triangle_of_float64_product(shape, dtype):
    batch, m = shape
    a = 3.4445
    R = symmetric(batch, m, dtype, seed=m + 1).cpu().to(torch.float64)
    # Two polynomials in the same R commute; rounding them to dtype breaks that by
    # rounding only, and the kernel is defined by its lower triangle.
    A = (0.5 * R + R @ R).to(dtype).to(DEVICE)
    B = (-4.775 * R + 2.0315 * R @ R).to(dtype).to(DEVICE)
    C = sym_mul(A, B, a)
    A64, B64 = A.cpu().to(torch.float64), B.cpu().to(torch.float64)
    exact = mirrored_lower(A64 @ B64 + a * A64)
    magnitude = mirrored_lower(A64.abs() @ B64.abs() + abs(a) * A64.abs())
    assert_within_one_ulp_of_fp32_accumulation(C.cpu(), exact, magnitude, m)


@pytest.mark.parametrize(
    ("name", "run", "reference"),
    [
        ("syrk", lambda X, A, B: syrk(X), lambda X, A, B: syrk_torch(X)),
        (
            "sym_poly",
            lambda X, A, B: sym_poly(A, -4.775, 2.0315, 1.5),
            lambda X, A, B: sym_poly_torch(A, -4.775, 2.0315, 1.5),
        ),
        (
            "sym_mul",
            lambda X, A, B: sym_mul(A, B, 3.4445),
            lambda X, A, B: sym_mul_torch(A, B, 3.4445),
        ),
    ],
    ids=["syrk", "sym_poly", "sym_mul"],
)
def test_each_kernel_matches_its_torch_form_in_fp32(name, run, reference):
    X = torch.randn(2, 100, 150, generator=gen(5)).to(DEVICE)
    A = symmetric(2, 100, torch.float32, seed=6)
    B = sym_poly_torch(A, 0.5, 1.0)  # a polynomial in A: commutes with it
    got, want = run(X, A, B), reference(X, A, B)
    # Same fp32 products summed in another order (torch: BLAS; Triton: 64-wide tiles):
    # relative differences of a few units of 2⁻²⁴·k; 1e-5 leaves room for k = 150.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "run",
    [
        lambda X, A, out: syrk(X, out=out),
        lambda X, A, out: sym_poly(A, 1.0, 1.0, 1.0, out=out),
        lambda X, A, out: sym_mul(A, A, 1.0, out=out),
    ],
    ids=["syrk", "sym_poly", "sym_mul"],
)
def test_every_entry_is_written_and_the_result_is_exactly_symmetric(run):
    X = torch.randn(2, 130, 90, generator=gen(7)).to(DEVICE)
    A = symmetric(2, 130, torch.float32, seed=8)
    out = torch.full((2, 130, 130), float("nan"), device=DEVICE)
    C = run(X, A, out)
    assert C.data_ptr() == out.data_ptr()
    assert not torch.isnan(C).any()
    assert torch.equal(C, C.mT)


def test_two_dimensional_in_two_dimensional_out():
    X = torch.randn(70, 30, generator=gen(9)).to(DEVICE)
    assert syrk(X).shape == (70, 70)
    A = symmetric(None, 70, torch.float32)
    assert sym_poly(A, 1.0, 1.0).shape == (70, 70)
    assert sym_mul(A, A, 0.0).shape == (70, 70)


def test_empty_dimensions():
    assert syrk(torch.empty(0, 5, 7, device=DEVICE)).shape == (0, 5, 5)
    assert syrk(torch.empty(3, 0, 7, device=DEVICE)).shape == (3, 0, 0)
    # k = 0: an empty sum is zero
    assert torch.equal(
        syrk(torch.empty(2, 4, 0, device=DEVICE)), torch.zeros(2, 4, 4, device=DEVICE)
    )


def test_lower_tile_count():
    assert lower_tile_count(130, 64) == 6  # 3 tiles per side: 3 + 2 + 1
    assert lower_tile_count(128, 64) == 3
    assert lower_tile_count(1, 64) == 1


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: syrk(ones(5)),
            r"syrk: X must be a \(m, k\) matrix or \(B, m, k\) batch, got shape \(5,\)",
        ),
        (lambda: syrk(ones(2, 2, 3, 4)), r"got shape \(2, 2, 3, 4\)"),
        (
            lambda: syrk(ones(3, 4, dtype=torch.float64)),
            r"X must be float16, bfloat16 or float32, got torch.float64",
        ),
        (lambda: syrk(ones(3, 4, dtype=torch.int32)), r"got torch.int32"),
        (
            lambda: syrk(ones(4, 3).mT),
            r"X must be contiguous, got strides \(1, 3\).*\.contiguous\(\)",
        ),
        (lambda: syrk("X"), r"X must be a torch.Tensor, got str"),
        (
            lambda: sym_poly(ones(3, 4), 1.0, 1.0),
            r"sym_poly: A must be square \(\.\.\., m, m\), got shape \(3, 4\)",
        ),
        (
            lambda: sym_mul(ones(3, 3), ones(4, 4), 1.0),
            r"sym_mul: A and B must have the same shape, dtype and device",
        ),
        (
            lambda: sym_mul(ones(3, 3), ones(3, 3, dtype=torch.float16)),
            r"same shape, dtype and device",
        ),
        (
            lambda: syrk(ones(3, 4), out=empty(4, 4)),
            r"syrk: out must be a contiguous tensor of shape \(3, 3\), torch.float32 on \S+; "
            r"got shape \(4, 4\)",
        ),
        (
            lambda: syrk(ones(3, 4), out=empty(3, 3, dtype=torch.float16)),
            r"out must be a contiguous tensor",
        ),
    ],
)
def test_bad_input_raises_naming_the_operand(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_out_must_not_overlap_an_input_but_may_share_its_storage():
    buffers = symmetric(3, 8, torch.float32)
    with pytest.raises(ValueError, match="out must not share memory with the inputs"):
        sym_poly(buffers[0], 1.0, 1.0, out=buffers[0])
    with pytest.raises(ValueError, match="out must not share memory with the inputs"):
        sym_mul(buffers[0], buffers[1], 1.0, out=buffers[1])
    # ping-pong buffers: distinct slices of one allocation are fine
    out = sym_poly(buffers[0], 1.0, 1.0, out=buffers[2])
    assert out.data_ptr() == buffers[2].data_ptr()
