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
    scalar = cost_model("all_reduce", 8, t, alpha=alpha, bandwidth=bw)
    assert got.gram_seconds == pytest.approx(
        flops / rate + (1 + r) * reduce.seconds + 2 * scalar.seconds
    )
    gather = cost_model("all_gather", b * m * n * 4, t, alpha=alpha, bandwidth=bw)
    assert got.gather_seconds == pytest.approx(ns_flops(m, n, batch=b) / rate + gather.seconds)
    assert got.gather_bytes == gather.bytes_sent
    assert got.path == ("gather" if got.gather_seconds < got.gram_seconds else "gram")


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
