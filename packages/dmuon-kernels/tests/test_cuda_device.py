"""A call on a CUDA device other than the current one runs on the tensor's device.

Triton launches, the autotuner's timing, and a CUDA graph's capture and replay all use
the current device's stream; ``torch.cuda.graph`` without ``stream=`` captures on a
stream made on whatever device was current. So a tensor on ``cuda:1`` while ``cuda:0``
is current (one process driving two GPUs, or a rank whose ``set_device`` was not called)
would run its kernels against the wrong device's stream: an error, an empty graph, or
replays that return the captured input's result. ``dispatch.run`` makes the tensor's
device current around the whole CUDA call, and the capture uses a stream of that device.

Needs two GPUs (the GPU check runs it where the machine has them); the same math on
one device is checked against eager in ``test_cuda_graphs.py``.
"""

import pytest
import torch

import dmuon.kernels.cuda_graphs as cuda_graphs
from dmuon.kernels import NSGraphCache, orthogonalize, release_cuda_graphs
from dmuon.kernels.cuda_graphs import graph_cache

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: runs in the GPU check"
)


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_graphed_calls_on_the_second_gpu_equal_eager_calls_there(monkeypatch, method, backend):
    if backend == "triton":
        pytest.importorskip("dmuon.kernels.triton")
    monkeypatch.setattr(cuda_graphs, "_CACHE", NSGraphCache(enabled=True))
    g = torch.Generator(device="cuda:1").manual_seed(0)
    inputs = [torch.randn(2, 256, 768, device="cuda:1", generator=g) for _ in range(4)]
    kw = dict(method=method, backend=backend)
    with torch.cuda.device(1):  # the reference: cuda:1 current, no graph
        eager = [orthogonalize(G, cuda_graph=False, **kw) for G in inputs]
    torch.cuda.set_device(0)
    # cuda:0 current: eager, capture + replay, replay, replay
    graphed = [orthogonalize(G, cuda_graph=True, **kw) for G in inputs]
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0  # the call restored the current device
    assert len(graph_cache()) == 1
    for i, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        assert a.device == torch.device("cuda:1")
        # an empty graph or a stale replay is off by O(1): the four inputs are independent
        assert rel_err(a, b) < 1e-2, f"call {i}"
    assert release_cuda_graphs() == 1


def test_triton_kernels_on_the_second_gpu_equal_torch_there():
    pytest.importorskip("dmuon.kernels.triton")
    from dmuon.kernels.symmetric_ops import sym_poly_torch, syrk_torch
    from dmuon.kernels.triton import sym_poly, syrk

    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda:1").manual_seed(1)
    X = torch.randn(3, 192, 320, device="cuda:1", generator=g).div_(320**0.5).half()
    S = syrk(X)
    assert S.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    assert rel_err(S, syrk_torch(X)) < 1e-2
    assert rel_err(sym_poly(S, -4.775, 2.0315), sym_poly_torch(S, -4.775, 2.0315)) < 1e-2
