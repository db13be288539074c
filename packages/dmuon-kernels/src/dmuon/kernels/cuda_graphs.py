"""CUDA-graph replay of whole Newton–Schulz calls, one graph per (shape, dtype, device, options).

One orthogonalisation launches 25–40 kernels (normalisation, 5 steps of 3–6
products, casts); an optimizer step over ~50 matrices issues over a thousand
launches whose host cost does not shrink with the matrix. Shapes repeat every
step (a model has 10–20 distinct ones), so DMuon records each call once as a CUDA
graph and replays it afterwards (DMuon ``ns_graph.py``; microsoft/dion
``CudaGraphOptimizer``):

* call 1 of a key runs eagerly (it also compiles and autotunes the Triton
  kernels, which must not happen during a capture);
* call 2 warms up on a side stream, captures the call into a graph reading a
  private static input, and replays it;
* call 3 onwards copies the input into the static buffer, replays, and returns a
  clone of the static output (the caller owns its result; the next replay
  overwrites the buffer).

Only the orthogonalisation is inside the graph; the learning rate, weight decay
and momentum are applied by the caller, so schedules change without re-capture.
The bookkeeping (:class:`NSGraphCache`) takes the capture function as a
parameter, which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable
from typing import Protocol

import torch

__all__ = [
    "CudaGraphCall",
    "NSGraphCache",
    "capture_cuda_graph",
    "cuda_graphs_enabled",
    "graph_cache",
    "release_cuda_graphs",
    "set_cuda_graphs_enabled",
]

_log = logging.getLogger("dmuon.kernels")
Call = Callable[[torch.Tensor], torch.Tensor]


class Replayable(Protocol):
    def replay(self, G: torch.Tensor) -> torch.Tensor: ...


class CudaGraphCall:
    """A captured call: static input, CUDA graph, static output.

    Built by :func:`capture_cuda_graph`; :meth:`replay` runs it on new data.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, static_in: torch.Tensor, static_out):
        self.graph = graph
        self.static_in = static_in
        self.static_out = static_out

    def replay(self, G: torch.Tensor) -> torch.Tensor:
        # a graph replays on the current device's stream: make the graph's device current
        with torch.cuda.device(self.static_in.device):
            self.static_in.copy_(G)
            self.graph.replay()
            return self.static_out.clone()


def capture_cuda_graph(fn: Call, example: torch.Tensor) -> CudaGraphCall:
    """Capture ``fn`` on a static copy of ``example`` as a CUDA graph.

    Everything happens with ``example``'s device current and on streams of that device:
    the warm-up's side stream and the capture stream. ``torch.cuda.graph`` without a
    ``stream=`` captures on a stream it made on whatever device was current when it was
    first used, which records nothing of work launched on another device's tensors.

    Raises:
        ValueError: ``example`` is not a CUDA tensor.
    """
    if example.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA tensor, got one on {example.device}")
    device = example.device
    with torch.cuda.device(device):
        static_in = example.detach().clone()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the capture (lazy init, workspaces)
            fn(static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(device=device)
        # thread_local: another thread (NCCL watchdog, data loader) may touch CUDA meanwhile.
        with torch.cuda.graph(graph, stream=capture, capture_error_mode="thread_local"):
            static_out = fn(static_in)
    return CudaGraphCall(graph, static_in, static_out)


def _enabled_by_env() -> bool:
    value = os.environ.get("DMUON_NS_CUDA_GRAPH", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


class NSGraphCache:
    """Counts calls per key, captures on the second, replays from then on.

    Args:
        capture: ``capture(fn, example) -> object with .replay(G)``; default
            :func:`capture_cuda_graph`.
        enabled: default on unless ``DMUON_NS_CUDA_GRAPH=0``.

    A key whose capture raised is remembered and runs eagerly from then on (one log
    line, no retry every step).

    Examples:
        >>> import torch
        >>> from dmuon.kernels import NSGraphCache
        >>> class Fake:
        ...     def __init__(self, fn, example): self.fn = fn
        ...     def replay(self, G): return self.fn(G)
        >>> cache = NSGraphCache(capture=Fake)
        >>> for _ in range(3):
        ...     out = cache.run("key", torch.neg, torch.ones(2))
        >>> len(cache), cache.calls("key")
        (1, 3)
    """

    def __init__(
        self,
        capture: Callable[[Call, torch.Tensor], Replayable] = capture_cuda_graph,
        enabled: bool | None = None,
    ) -> None:
        self._capture = capture
        self.enabled: bool = _enabled_by_env() if enabled is None else bool(enabled)
        self._graphs: dict[Hashable, Replayable] = {}
        self._calls: dict[Hashable, int] = {}
        self._failed: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def calls(self, key: Hashable) -> int:
        """How many calls of ``key`` were seen since it was last released."""
        return self._calls.get(key, 0)

    def run(self, key: Hashable, fn: Call, G: torch.Tensor, *, force: bool = False) -> torch.Tensor:
        """``fn(G)``, eagerly on the first call of ``key``, through a graph afterwards.

        ``force=True`` uses graphs even when the cache is disabled (an explicit
        ``cuda_graph=True``).
        """
        if not (self.enabled or force):
            return fn(G)
        self._calls[key] = self._calls.get(key, 0) + 1
        graph = self._graphs.get(key)
        if graph is not None:
            return graph.replay(G)
        if key in self._failed or self._calls[key] < 2:
            return fn(G)
        try:
            graph = self._capture(fn, G)
        except Exception as exc:
            self._failed.add(key)
            _log.warning("CUDA-graph capture failed for %s, running eagerly: %s", key, exc)
            return fn(G)
        self._graphs[key] = graph
        return graph.replay(G)

    def release(self, key: Hashable | None = None) -> int:
        """Drop the graph of ``key`` (all graphs if ``None``) and its call count.

        Returns the number of graphs released. Their memory returns to the caching
        allocator once no result refers to it (results are clones, so at once).
        """
        keys = list(self._graphs) if key is None else [key]
        released = sum(self._graphs.pop(k, None) is not None for k in keys)
        if key is None:
            self._calls.clear()
            self._failed.clear()
        else:
            self._calls.pop(key, None)
            self._failed.discard(key)
        return released


_CACHE = NSGraphCache()


def graph_cache() -> NSGraphCache:
    """The process-wide :class:`NSGraphCache` the Newton–Schulz entry points use."""
    return _CACHE


def release_cuda_graphs() -> int:
    """Release every captured Newton–Schulz graph; returns how many were released.

    Call it before changing the set of shapes for good, to free memory, or before
    ``destroy_process_group``.

    Examples:
        >>> from dmuon.kernels import release_cuda_graphs
        >>> release_cuda_graphs()
        0
    """
    return _CACHE.release()


def set_cuda_graphs_enabled(enabled: bool) -> None:
    """Turn CUDA-graph replay of Newton–Schulz calls on or off for this process.

    Turning it off also releases the graphs. The initial value is on unless the
    environment has ``DMUON_NS_CUDA_GRAPH=0``; ``cuda_graph=`` on a call overrides it.

    Examples:
        >>> from dmuon.kernels import cuda_graphs_enabled, set_cuda_graphs_enabled
        >>> set_cuda_graphs_enabled(False)
        >>> cuda_graphs_enabled()
        False
        >>> set_cuda_graphs_enabled(True)
    """
    _CACHE.enabled = bool(enabled)
    if not enabled:
        _CACHE.release()


def cuda_graphs_enabled() -> bool:
    """Whether Newton–Schulz calls on CUDA are captured and replayed by default.

    On by default; ``DMUON_NS_CUDA_GRAPH=0`` or :func:`set_cuda_graphs_enabled` turn it off.

    Examples:
        >>> from dmuon.kernels import cuda_graphs_enabled
        >>> isinstance(cuda_graphs_enabled(), bool)
        True
    """
    return _CACHE.enabled
