"""cost_model (α–β) and CommStats."""

import threading

import pytest

from dmuon.comm import COLLECTIVES, CommStats, cost_model


@pytest.mark.parametrize("N", [2, 3, 8])
def test_formulas(N):
    B, alpha, bw = 3 * 2**20, 5e-6, 2e10
    ring = cost_model("all_reduce", B, N, alpha=alpha, bandwidth=bw)
    assert ring.steps == 2 * (N - 1)
    assert ring.bytes_sent == ring.bytes_received == pytest.approx(2 * (N - 1) / N * B)
    assert ring.seconds == pytest.approx(2 * (N - 1) * alpha + 2 * (N - 1) / N * B / bw)
    for op in ("reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"):
        c = cost_model(op, B, N, alpha=alpha, bandwidth=bw)
        assert (c.steps, c.bytes_sent) == (N - 1, pytest.approx((N - 1) / N * B))
        assert c.seconds == pytest.approx((N - 1) * alpha + (N - 1) / N * B / bw)


def test_owner_traffic_equals_one_ring_all_reduce():
    P, N = 10**8, 8
    owner = cost_model("reduce", P, N).bytes_sent + cost_model("broadcast", P, N).bytes_sent
    assert owner == pytest.approx(cost_model("all_reduce", P, N).bytes_sent)


def test_one_rank_moves_nothing_and_bad_input():
    assert all(cost_model(op, 100, 1).seconds == 0 for op in COLLECTIVES)
    with pytest.raises(ValueError, match="op must be one of"):
        cost_model("gather", 1, 2)
    with pytest.raises(ValueError, match="nbytes must be an int ≥ 0"):
        cost_model("reduce", -1, 2)
    with pytest.raises(ValueError, match="world_size must be an int ≥ 1"):
        cost_model("reduce", 1, 0)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        cost_model("reduce", 1, 2, bandwidth=0)


def test_stats_record_read_reset_and_are_thread_safe():
    stats = CommStats()
    stats.count_call("x")
    stats.record_collective("x", "all_gather", nbytes=100, world_size=4)  # output 400 B
    assert stats["x"].calls == 1 and stats["x"].collectives == 1
    assert stats["x"].payload_bytes == 100 and stats["x"].bytes_sent == pytest.approx(300.0)
    assert stats["never"].calls == 0 and "never" not in stats

    def hammer():
        for _ in range(1000):
            stats.record("y", collectives=1, payload_bytes=1, bytes_sent=1.0, bytes_received=2.0)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats["y"].collectives == 4000 and stats.total_bytes_received == pytest.approx(8300.0)
    assert stats.as_dict()["y"]["bytes_sent"] == 4000.0
    stats.reset()
    assert stats.ops == {} and stats.total_bytes_sent == 0.0
