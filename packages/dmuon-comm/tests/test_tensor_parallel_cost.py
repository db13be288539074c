"""The choice between the Gram path and the gather path for a tensor-parallel matrix."""

from __future__ import annotations

import pytest

from dmuon.comm import cost_model, ns_flops, tensor_parallel_path
from dmuon.comm.tensor_parallel_cost import gram_restarts


def test_prices_restate_the_module_formulas():
    m, n, t, b, steps = 3000, 700, 4, 2, 5  # rows split: Gram side n = 700, the short one
    rate, alpha, bw = 1e13, 2e-5, 5e10
    got = tensor_parallel_path(
        m, n, -2, t, batch=b, flops_per_second=rate, alpha=alpha, bandwidth=bw
    )
    r = 1  # one restart at step 2 on the short side
    local = -(-m // t)
    flops = b * (4 * (1 + r) * n * n * local + (8 * steps - 6 - 6 * r) * n**3)
    reduce = cost_model("all_reduce", b * n * n * 4, t, alpha=alpha, bandwidth=bw)
    maxima = cost_model("all_reduce", b * 4, t, alpha=alpha, bandwidth=bw)  # b fp32 maxima
    norms = cost_model("all_reduce", (b + 1) * 4, t, alpha=alpha, bandwidth=bw)  # + split size
    assert got.gram_seconds == pytest.approx(
        flops / rate + (1 + r) * reduce.seconds + maxima.seconds + norms.seconds
    )
    gather = cost_model("all_gather", b * m * n * 4, t, alpha=alpha, bandwidth=bw)
    assert got.gather_seconds == pytest.approx(ns_flops(m, n, batch=b) / rate + gather.seconds)
    assert got.gather_bytes == gather.bytes_sent
    assert got.path == ("gather" if got.gather_seconds < got.gram_seconds else "gram")


@pytest.mark.parametrize(("gram_e", "gather_e"), [(2, 4), (4, 2), (2, 2), (8, 8)])
def test_each_path_is_priced_in_the_bytes_it_sends(gram_e, gather_e):
    """The Gram matrices travel in the compute dtype (fp16 on a GPU: 2 bytes), the shards
    in the chain's (fp32: 4): the byte counts by hand, from the ring algorithms' per-rank
    traffic (an all-reduce sends 2(t−1)/t of its message, an all-gather (t−1)/t of its
    output), not through cost_model."""
    m, n, t, b = 3000, 700, 4, 2  # rows split: the Gram side is n = 700 (the short one)
    r = 1  # one restart, at step 2
    got = tensor_parallel_path(
        m, n, -2, t, batch=b, gram_element_size=gram_e, gather_element_size=gather_e
    )
    gram = (1 + r) * 2 * (t - 1) / t * (b * n * n * gram_e)  # the Gram all-reduces
    # the normalisation: the b maxima, then the b squared norms and the split size, fp32
    scalars = 2 * (t - 1) / t * (b * 4 + (b + 1) * 4)
    assert got.gram_bytes == pytest.approx(gram + scalars, rel=1e-12)
    assert got.gather_bytes == pytest.approx((t - 1) / t * (b * m * n * gather_e), rel=1e-12)
    # element_size is the default of both, and neither size reaches the other path's price
    same = tensor_parallel_path(m, n, -2, t, batch=b, element_size=gram_e)
    assert same.gram_bytes == got.gram_bytes and same.gram_seconds == got.gram_seconds
    same = tensor_parallel_path(m, n, -2, t, batch=b, element_size=gather_e)
    assert same.gather_bytes == got.gather_bytes and same.gather_seconds == got.gather_seconds


def test_the_gram_matrices_dtype_decides_a_close_case():
    """A 4096 × 5120 row split over 4 (Gram side 5120, the long one: a restart at every
    step) gathers when its Gram matrices are priced in fp32 like its shards, and stays on
    the shards when they are priced in fp16, what they travel in on a GPU: the
    all-reduces cost half, the gather the same."""
    m, n, t = 4096, 5120, 4
    fp32 = tensor_parallel_path(m, n, -2, t, element_size=4)
    fp16_gram = tensor_parallel_path(m, n, -2, t, gram_element_size=2, gather_element_size=4)
    assert fp16_gram.gather_seconds == fp32.gather_seconds
    assert (fp32.path, fp16_gram.path) == ("gather", "gram")


def test_the_long_unsplit_side_gathers_and_the_short_one_stays_on_the_shards():
    for t in (2, 4, 8):
        assert tensor_parallel_path(8192, 2048, -2, t).path == "gram"  # colwise up-projection
        assert tensor_parallel_path(2048, 8192, -1, t).path == "gram"  # rowwise down-projection
        assert tensor_parallel_path(2048, 8192, -2, t).path == "gather"  # Gram side 8192
        assert tensor_parallel_path(8192, 2048, -1, t).path == "gather"


def test_restarts_follow_the_kernel_rule():
    assert gram_restarts(10, 4, -2, 5) == (2,)
    assert gram_restarts(4, 10, -2, 5) == (1, 2, 3, 4)
    assert gram_restarts(4, 10, -1, 5) == (2,)
    assert gram_restarts(10, 4, -1, 2) == (1,)


@pytest.mark.parametrize(
    ("args", "match"),
    [((8, 8, 0, 2), "split_dim"), ((0, 8, -1, 2), "m, n"), ((8, 8, -1, 0), "world_size")],
)
def test_bad_input_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        tensor_parallel_path(*args)


@pytest.mark.parametrize("key", ["gram_element_size", "gather_element_size"])
def test_a_bad_element_size_is_named(key):
    with pytest.raises(ValueError, match=f"{key}=0"):
        tensor_parallel_path(8, 8, -1, 2, **{key: 0})
