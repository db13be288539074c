"""Property-based checks over shapes and scales a training run can produce."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dmuon.kernels import orthogonalize

# Largest magnitude each input dtype can hold with room for the Frobenius norm.
SCALES = {
    torch.float64: [0.0, 1e-30, 1.0, 1e30],
    torch.float32: [0.0, 1e-30, 1.0, 1e30],
    torch.bfloat16: [0.0, 1e-30, 1.0, 1e30],
    torch.float16: [0.0, 1e-4, 1.0, 1e4],  # fp16 holds |x| in [6e-8, 65504]
}

batch_shapes = st.lists(st.integers(0, 3), min_size=0, max_size=2)
dims = st.integers(0, 9)


@given(
    batch=batch_shapes,
    m=dims,
    n=dims,
    dtype=st.sampled_from(list(SCALES)),
    scale_index=st.integers(0, 3),
    method=st.sampled_from(["gram", "standard"]),
    compute=st.sampled_from([None, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_finite_output_of_same_shape_and_dtype(
    batch, m, n, dtype, scale_index, method, compute, seed
):
    scale = SCALES[dtype][scale_index]
    g = torch.Generator().manual_seed(seed)
    G = (torch.randn(*batch, m, n, generator=g, dtype=torch.float64) * scale).to(dtype)
    if dtype == torch.float16 and compute is None:
        compute = torch.float32  # fp16 input, but keep CPU matmuls off the slow fp16 path
    O = orthogonalize(G, method=method, compute_dtype=compute)
    assert O.shape == G.shape and O.dtype == G.dtype
    assert torch.isfinite(O).all()
    if scale == 0.0:
        assert not O.any()
    elif G.numel() and (G != 0).any():
        # Non-zero input: output entries are bounded by the band ceiling (≤ 1.21 in
        # spectral norm; bf16 rounding may add a few percent).
        assert O.abs().max() <= 1.3


@given(
    ndim=st.integers(0, 1),
    dtype=st.sampled_from([torch.int64, torch.int8, torch.bool, torch.complex64]),
)
def test_invalid_inputs_raise_value_error(ndim, dtype):
    G = torch.zeros((3,) * ndim) if ndim < 2 else torch.zeros(3, 3)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        orthogonalize(G)
    with pytest.raises(ValueError, match="real floating-point"):
        orthogonalize(torch.zeros(2, 3, dtype=dtype))


@given(m=st.integers(1, 8), n=st.integers(1, 8), seed=st.integers(0, 1000))
def test_one_by_n_and_n_by_one_are_unit_vectors(m, n, seed):
    # A rank-one matrix has one singular value, σ/‖G‖_F = 1 → φ(1), and the polar
    # factor is u vᵀ.
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(1, n, generator=g, dtype=torch.float64)
    O = orthogonalize(G, compute_dtype=torch.float64)
    direction = G / G.norm()
    torch.testing.assert_close(O / O.norm(), direction)
    O2 = orthogonalize(G.mT, compute_dtype=torch.float64)
    torch.testing.assert_close(O2, O.mT)
