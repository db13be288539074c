"""orthogonalize / newton_schulz / gram_newton_schulz against a float64 SVD.

Exact arithmetic Newton–Schulz returns U φ(Σ) Vᵀ, φ the composed scalar
polynomial; in float64 compute the iterations must reproduce it to ~1e-10
(rounding of 5 steps of products of unit-norm matrices), which checks the
singular values *and* vectors at once.
"""

import math

import pytest
import torch
from nsref import expected_output, matrix_with_singular_values, normalised_svd, rel_err

from dmuon.kernels import (
    COEFFICIENT_SETS,
    gram_newton_schulz,
    newton_schulz,
    orthogonalize,
    polar_factor,
)

SHAPES = [(48, 48), (32, 160), (160, 32), (1, 40), (40, 1), (24, 100)]


def spectrum(kind: str, k: int) -> torch.Tensor:
    if kind == "random":
        return torch.linspace(1.0, 0.3, k)
    if kind == "low_rank":
        sv = torch.zeros(k)
        sv[: max(1, k // 4)] = torch.linspace(1.0, 0.5, max(1, k // 4))
        return sv
    if kind == "ill_conditioned":  # condition number 1e4
        return torch.logspace(0, -4, k)
    raise AssertionError(kind)


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("kind", ["random", "low_rank", "ill_conditioned"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_svd_composition_in_float64(name, method, kind, shape):
    m, n = shape
    G = matrix_with_singular_values(m, n, spectrum(kind, min(m, n)), seed=m * 1000 + n)
    O = orthogonalize(G, method=method, coefficients=name, compute_dtype=torch.float64)
    assert O.dtype == torch.float64 and O.shape == G.shape
    assert rel_err(O, expected_output(G, name)) < 1e-9


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(64, 64), (32, 192), (192, 32)], ids=str)
def test_singular_values_in_documented_band_and_vectors_match_polar(name, method, shape):
    cset = COEFFICIENT_SETS[name]
    m, n = shape
    k = min(m, n)
    # As ill-conditioned as the set's promise allows: σ_min/‖G‖_F ≥ lower (‖σ‖ ≤ √k).
    smallest = 1.01 * cset.lower * k**0.5
    G = matrix_with_singular_values(m, n, torch.logspace(0, math.log10(smallest), k), seed=k)
    _, S, _ = normalised_svd(G)
    assert S.min() >= cset.lower
    O = orthogonalize(G.float(), method=method, coefficients=name, compute_dtype=torch.float32)
    sv = torch.linalg.svdvals(O.double())
    # fp32 rounding moves singular values by ~1e-5 at most.
    assert sv.min() >= cset.band[0] - 1e-4
    assert sv.max() <= cset.band[1] + 1e-4
    # Singular vectors: O = U diag(d) Vᵀ with the reference polar factor's U, V, so
    # the cosine between O and P = U Vᵀ is ⟨d, 1⟩/(‖d‖·√k) ≥ 2√(lo·hi)/(lo + hi)
    # for d in the band [lo, hi] (the extreme is half the entries at each end).
    P = polar_factor(G)
    cos = (O.double() * P).sum() / (O.double().norm() * P.norm())
    lo, hi = cset.band
    assert cos > 2 * math.sqrt(lo * hi) / (lo + hi) - 1e-6
    # and O Pᵀ is symmetric positive definite (same left/right vectors).
    OP = O.double().mT @ P if m > n else O.double() @ P.mT
    assert rel_err(OP, OP.mT) < 1e-4
    assert torch.linalg.eigvalsh(0.5 * (OP + OP.mT)).min() > 0


@pytest.mark.parametrize(
    ("compute_dtype", "tol"),
    # bf16 has an 8-bit mantissa (unit roundoff 4e-3); five steps of products keep the
    # relative error near 1e-2 for the standard iteration. The Gram iteration evolves
    # R without re-forming X between restarts, so its rounding compounds to ~3e-2.
    [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 6e-2)],
)
@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (6, 24, 96)], ids=str)
def test_gram_equals_standard(compute_dtype, tol, shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = orthogonalize(G, method="gram", compute_dtype=compute_dtype)
    s = orthogonalize(G, method="standard", compute_dtype=compute_dtype)
    assert rel_err(g, s) < tol


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_batched_equals_loop_of_single_calls(method):
    G = torch.randn(2, 3, 24, 80, generator=torch.Generator().manual_seed(2))
    batched = orthogonalize(G, method=method, compute_dtype=torch.float32)
    looped = torch.stack(
        [
            torch.stack(
                [
                    orthogonalize(G[i, j], method=method, compute_dtype=torch.float32)
                    for j in range(3)
                ]
            )
            for i in range(2)
        ]
    )
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tall_path_equals_orthogonalising_the_transpose(method, dtype):
    # On the CPU the tall matrix is iterated in its own layout (XᵀX instead of a
    # transposed copy's XXᵀ, _layout.to_wide_normalized(tall_in_place=True)): the same
    # arithmetic summed in another memory order, so equal to rounding (one ulp of the
    # result's dtype), no longer bit for bit.
    G = torch.randn(96, 24, generator=torch.Generator().manual_seed(3)).to(dtype)
    tall = orthogonalize(G, method=method)
    wide = orthogonalize(G.mT.contiguous(), method=method)
    torch.testing.assert_close(tall, wide.mT)


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(96, 24), (3, 80, 16), (2, 2, 64, 32)], ids=str)
def test_tall_path_keeps_the_layout_and_matches_the_transposed_copy(shape, method, compute):
    # Reference: the plain path of before, a transposed contiguous copy iterated wide
    # and transposed back; and fp64 on the same copy, for the size of the error.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    tall = orthogonalize(G, method=method, compute_dtype=compute)
    assert tall.shape == G.shape and tall.is_contiguous()  # nothing transposed in memory
    wide = orthogonalize(G.mT.contiguous(), method=method, compute_dtype=compute).mT
    exact = orthogonalize(G.double().mT.contiguous(), method=method, compute_dtype=torch.float64)
    err_wide = (wide.double() - exact.mT).norm() / exact.norm()
    err_tall = (tall.double() - exact.mT).norm() / exact.norm()
    assert err_tall <= 1.5 * err_wide + 1e-6  # no less accurate than the transposed copy
    tol = dict(rtol=1e-5, atol=1e-5) if compute == torch.float32 else dict(rtol=0.0, atol=0.05)
    torch.testing.assert_close(tall, wide, **tol)


def test_entry_points_agree():
    G = torch.randn(20, 70, dtype=torch.float64)
    kw = dict(coefficients="you", steps=5, compute_dtype=torch.float64)
    torch.testing.assert_close(newton_schulz(G, **kw), orthogonalize(G, method="standard", **kw))
    torch.testing.assert_close(
        gram_newton_schulz(G, restarts=(1, 3), **kw),
        orthogonalize(G, method="gram", restarts=(1, 3), **kw),
    )


@pytest.mark.parametrize("restarts", [(), (1,), (2,), (1, 2, 3, 4), (4,)])
def test_restarts_do_not_change_the_exact_map(restarts):
    G = torch.randn(16, 64, dtype=torch.float64)
    O = gram_newton_schulz(G, restarts=restarts, compute_dtype=torch.float64)
    assert rel_err(O, expected_output(G, "polar_express")) < 1e-10


def test_square_gram_falls_back_to_standard_bitwise():
    G = torch.randn(40, 40)
    a = orthogonalize(G, method="gram", compute_dtype=torch.float32)
    b = orthogonalize(G, method="standard", compute_dtype=torch.float32)
    assert torch.equal(a, b)


def test_input_is_not_modified_and_dtype_is_kept():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        G = torch.randn(8, 20).to(dtype)
        before = G.clone()
        O = orthogonalize(G, compute_dtype=torch.float32)
        assert O.dtype == dtype and O.shape == G.shape
        assert torch.equal(G, before)


def test_result_is_scale_invariant():
    G = torch.randn(16, 48, dtype=torch.float64)
    ref = orthogonalize(G, compute_dtype=torch.float64)
    for scale in (1e-30, 1e-8, 1e8, 1e30):
        torch.testing.assert_close(orthogonalize(G * scale, compute_dtype=torch.float64), ref)


def test_zero_matrix_gives_zeros():
    for method in ("gram", "standard"):
        O = orthogonalize(torch.zeros(3, 8, 16), method=method)
        assert torch.equal(O, torch.zeros(3, 8, 16))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (3, 0, 4), (0, 4, 4)], ids=str)
def test_empty_input_gives_empty_result(shape):
    O = orthogonalize(torch.empty(shape))
    assert O.shape == torch.Size(shape)


@pytest.mark.parametrize(
    ("G", "match"),
    [
        (torch.randn(5), r"at least 2 dimensions.*shape \(5,\)"),
        (torch.tensor(1.0), r"at least 2 dimensions.*shape \(\)"),
        (torch.ones(3, 4, dtype=torch.int64), r"real floating-point.*torch.int64.*\(3, 4\)"),
        (torch.ones(3, 4, dtype=torch.complex64), r"real floating-point.*complex64"),
        (torch.ones(0, 4, dtype=torch.int32), r"real floating-point.*int32"),
    ],
)
def test_bad_input_raises_naming_shape_and_dtype(G, match):
    with pytest.raises(ValueError, match=match):
        orthogonalize(G)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "svd"}, r"method must be one of \('gram', 'standard'\), got 'svd'"),
        ({"coefficients": "muon"}, "unknown coefficient set 'muon'"),
        ({"steps": 0}, "steps must be a positive integer, got 0"),
        ({"restarts": (5,)}, r"restarts must be iteration indices in \[1, 5\)"),
        ({"restarts": (0,)}, r"restarts must be iteration indices in \[1, 5\)"),
        ({"restarts": 2}, r"restarts must be a sequence of iteration indices in \[1, 5\)"),
        ({"eps": -1.0}, "eps must be a finite number > 0, got -1.0"),
        ({"eps": float("nan")}, "eps must be a finite number > 0, got nan"),
        ({"compute_dtype": torch.int32}, "compute_dtype must be None .* got torch.int32"),
        ({"compute_dtype": "float32"}, "compute_dtype must be None .* got 'float32'"),
        # fp8 has no batched matmul (NotImplementedError deep in torch before)
        ({"compute_dtype": torch.float8_e4m3fn}, "compute_dtype .* one of torch.float16"),
        # the argument named (TypeError "'NoneType' object is not iterable" before)
        ({"coefficients": None}, r"coefficients must be a set's name .* got None"),
        ({"coefficients": [("a", 0, 0)]}, r"coefficients\[0\] must be three finite real"),
        ({"coefficients": [(float("nan"), 0, 0)]}, r"coefficients\[0\] must be three finite"),
        ({"steps": 3, "restarts": (3,)}, r"restarts must be iteration indices in \[1, 3\)"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        orthogonalize(torch.randn(4, 8), **kwargs)


@pytest.mark.parametrize("steps", [1, 2])
def test_short_schedules_run_without_the_default_restart(steps):
    """The default restart (2,) lies past a 1- or 2-step schedule: the call runs as with
    ``restarts=()`` (it raised, and so did ``DMuon(ns_steps=2)``)."""
    G = torch.randn(2, 6, 10, generator=torch.Generator().manual_seed(0))
    got = orthogonalize(G, steps=steps, compute_dtype=torch.float32)
    want = orthogonalize(G, steps=steps, restarts=(), compute_dtype=torch.float32)
    assert torch.equal(got, want)
    # the default given as a list is the default too
    assert torch.equal(
        orthogonalize(G, steps=steps, restarts=[2], compute_dtype=torch.float32), want
    )


def test_bf16_restarts_at_three_by_default():
    """bf16's evolved Gram matrix drifts: with a restart at 2 the top singular value of
    a wide matrix whose spectrum spreads over three decades reached 1.38; the default
    restarts at 3 in bf16 (the same cost) and stays within the fp16 band."""
    sv = torch.logspace(0, -3, 64, dtype=torch.float64)
    G = matrix_with_singular_values(64, 256, sv, seed=3).to(torch.float32)
    got = orthogonalize(G, compute_dtype=torch.bfloat16)
    assert torch.equal(got, orthogonalize(G, compute_dtype=torch.bfloat16, restarts=(3,)))
    assert torch.linalg.svdvals(got.double()).max() < 1.2
    at_two = orthogonalize(G, compute_dtype=torch.bfloat16, restarts=(2,))  # still honoured
    assert torch.linalg.svdvals(at_two.double()).max() > 1.2
    # fp16 and fp32 keep the restart at 2; a 3-step bf16 schedule restarts at 2
    for dtype in (torch.float16, torch.float32):
        want = orthogonalize(G, compute_dtype=dtype, restarts=(2,))
        assert torch.equal(orthogonalize(G, compute_dtype=dtype), want)
    want = orthogonalize(G, steps=3, compute_dtype=torch.bfloat16, restarts=(2,))
    assert torch.equal(orthogonalize(G, steps=3, compute_dtype=torch.bfloat16), want)
