"""CUDA-graph bookkeeping: capture on the second call per key, replay after, off switch,
release. The capture function is a stand-in on the CPU; the real capture runs in the
GPU check (the last test here needs CUDA)."""

import logging

import pytest
import torch
from nsref import rel_err

import dmuon.kernels.cuda_graphs as cuda_graphs
from dmuon.kernels import (
    NSGraphCache,
    cuda_graphs_enabled,
    orthogonalize,
    release_cuda_graphs,
    set_cuda_graphs_enabled,
)
from dmuon.kernels.cuda_graphs import capture_cuda_graph, graph_cache
from dmuon.kernels.dispatch import graph_key, wants_graph


class FakeCapture:
    """Records captures and replays; a replay computes what fn computes, without counting
    as an eager call of it."""

    def __init__(self):
        self.captured = []
        self.replayed = 0

    def __call__(self, fn, example):
        self.captured.append(example.shape)
        outer = self

        class Graph:
            def replay(self, G):
                outer.replayed += 1
                return getattr(fn, "pure", fn)(G)

        return Graph()


class CountingFn:
    def __init__(self):
        self.eager = 0

    def __call__(self, G):
        self.eager += 1
        return self.pure(G)

    @staticmethod
    def pure(G):
        return G * 2


def test_first_call_eager_second_captures_then_replays():
    capture, fn = FakeCapture(), CountingFn()
    cache = NSGraphCache(capture=capture, enabled=True)
    G = torch.ones(3)
    assert torch.equal(cache.run("k", fn, G), G * 2)
    assert (fn.eager, len(capture.captured), capture.replayed) == (1, 0, 0)
    assert torch.equal(cache.run("k", fn, G), G * 2)
    assert (len(capture.captured), capture.replayed) == (1, 1) and "k" in cache
    for _ in range(3):
        cache.run("k", fn, G)
    assert (fn.eager, len(capture.captured), capture.replayed) == (1, 1, 4)
    assert cache.calls("k") == 5


def test_keys_are_independent():
    capture, fn = FakeCapture(), CountingFn()
    cache = NSGraphCache(capture=capture, enabled=True)
    for key in ("a", "b", "a", "c", "b", "a"):
        cache.run(key, fn, torch.ones(2))
    assert sorted(k for k in ("a", "b", "c") if k in cache) == ["a", "b"]
    assert (cache.calls("a"), cache.calls("b"), cache.calls("c")) == (3, 2, 1)


def test_disabled_cache_never_captures_unless_forced():
    capture, fn = FakeCapture(), CountingFn()
    cache = NSGraphCache(capture=capture, enabled=False)
    for _ in range(3):
        cache.run("k", fn, torch.ones(2))
    assert capture.captured == [] and fn.eager == 3 and cache.calls("k") == 0
    for _ in range(2):
        cache.run("k", fn, torch.ones(2), force=True)
    assert len(capture.captured) == 1


def test_release_one_key_or_all():
    capture, fn = FakeCapture(), CountingFn()
    cache = NSGraphCache(capture=capture, enabled=True)
    for key in ("a", "a", "b", "b"):
        cache.run(key, fn, torch.ones(2))
    assert len(cache) == 2
    assert cache.release("a") == 1 and "a" not in cache and cache.calls("a") == 0
    cache.run("a", fn, torch.ones(2))  # counts as a first call again: eager
    assert len(capture.captured) == 2
    cache.run("a", fn, torch.ones(2))  # and captures on the second
    assert len(capture.captured) == 3
    assert cache.release() == 2 and len(cache) == 0


def test_failed_capture_runs_eagerly_from_then_on_and_says_so_once(caplog):
    attempts = []

    def failing(fn, example):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    fn = CountingFn()
    cache = NSGraphCache(capture=failing, enabled=True)
    with caplog.at_level(logging.WARNING, logger="dmuon.kernels"):
        outs = [cache.run("k", fn, torch.ones(2)) for _ in range(4)]
    assert all(torch.equal(o, torch.full((2,), 2.0)) for o in outs)
    assert len(attempts) == 1 and fn.eager == 4
    assert caplog.text.count("CUDA-graph capture failed") == 1


def test_environment_variable_turns_graphs_off(monkeypatch):
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "0")
    assert not NSGraphCache().enabled
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "1")
    assert NSGraphCache().enabled


def test_global_switch_releases_graphs(monkeypatch):
    capture = FakeCapture()
    monkeypatch.setattr(cuda_graphs, "_CACHE", NSGraphCache(capture=capture, enabled=True))
    fn = CountingFn()
    for _ in range(2):
        graph_cache().run("k", fn, torch.ones(2))
    assert len(graph_cache()) == 1
    set_cuda_graphs_enabled(False)
    assert not cuda_graphs_enabled() and len(graph_cache()) == 0
    set_cuda_graphs_enabled(True)
    assert cuda_graphs_enabled()
    for _ in range(2):
        graph_cache().run("k", fn, torch.ones(2))
    assert release_cuda_graphs() == 1


def test_when_a_call_uses_graphs():
    base = dict(
        device_type="cuda", cuda_graph=None, enabled=True, capturing=False, needs_grad=False
    )
    assert wants_graph(**base)
    assert not wants_graph(**{**base, "device_type": "cpu"})
    assert not wants_graph(**{**base, "device_type": "cpu", "cuda_graph": True})
    assert not wants_graph(**{**base, "enabled": False})
    assert wants_graph(**{**base, "enabled": False, "cuda_graph": True})
    assert not wants_graph(**{**base, "cuda_graph": False})
    assert not wants_graph(**{**base, "capturing": True})  # inside the caller's own graph
    assert not wants_graph(**{**base, "needs_grad": True})


def test_graph_key_is_per_shape_dtype_device_and_options():
    def key(G, **kw):
        args = dict(
            method="gram",
            compute_dtype=torch.float16,
            schedule=((3.0, -4.0, 2.0),),
            restarts=(2,),
            eps=1e-7,
            ops_name="torch",
        )
        args.update(kw)
        return graph_key(G, **args)

    G = torch.ones(4, 8)
    assert key(G) == key(torch.zeros(4, 8))  # data is not part of the key
    variants = [
        key(torch.ones(8, 4)),
        key(torch.ones(2, 4, 8)),
        key(G.double()),
        key(G, method="standard"),
        key(G, compute_dtype=torch.bfloat16),
        key(G, schedule=((3.0, -4.0, 2.1),)),
        key(G, restarts=()),
        key(G, eps=1e-6),
        key(G, ops_name="triton"),
    ]
    assert len({key(G), *variants}) == 1 + len(variants)


def test_cpu_calls_never_touch_the_graph_cache(monkeypatch):
    capture = FakeCapture()
    monkeypatch.setattr(cuda_graphs, "_CACHE", NSGraphCache(capture=capture, enabled=True))
    G = torch.randn(16, 40)
    outs = [orthogonalize(G, cuda_graph=True) for _ in range(3)]
    assert capture.captured == [] and len(graph_cache()) == 0
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_real_capture_refuses_a_cpu_tensor():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA tensor, got one on cpu"):
        capture_cuda_graph(torch.neg, torch.ones(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs in the GPU check")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_real_cuda_graph_replay_equals_eager(monkeypatch, method, backend):
    if backend == "triton":
        pytest.importorskip("dmuon.kernels.triton")
    monkeypatch.setattr(cuda_graphs, "_CACHE", NSGraphCache(enabled=True))
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(3, 256, 1024, device="cuda", generator=g) for _ in range(4)]
    kw = dict(method=method, backend=backend)
    eager = [orthogonalize(G, cuda_graph=False, **kw) for G in inputs]
    graphed = [orthogonalize(G, **kw) for G in inputs]  # eager, capture+replay, replay, replay
    assert len(graph_cache()) == 1
    for a, b in zip(graphed, eager, strict=True):
        # Same kernels on the same data; cuBLAS may pick another algorithm under capture
        # (its workspace differs), so allow half-precision rounding. A replay that missed
        # the new input would be off by O(1): the four inputs are independent.
        assert rel_err(a, b) < 1e-2
    assert graphed[2].data_ptr() != graphed[3].data_ptr()  # results are not the static buffer
    assert release_cuda_graphs() == 1
