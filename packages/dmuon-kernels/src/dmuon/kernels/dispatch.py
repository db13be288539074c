"""One Newton–Schulz call end to end: backend, autotune, CUDA graph, preparation and way back.

Every public entry point (:func:`~dmuon.kernels.orthogonalize`,
:func:`~dmuon.kernels.newton_schulz`, :func:`~dmuon.kernels.gram_newton_schulz`)
hands its iteration to :func:`execute` as ``iterate(X, ops)``; this module decides
which :class:`~dmuon.kernels.SymmetricOps` it runs with and whether the whole
call goes through a CUDA graph. It knows nothing about the iterations themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dmuon.kernels._layout import check_matrix_input, empty_result, restore, to_wide_normalized
from dmuon.kernels.autotune import default_autotuner
from dmuon.kernels.backends import BACKENDS, resolve_backend, triton_candidates
from dmuon.kernels.coefficients import Schedule
from dmuon.kernels.compute_dtype import default_compute_dtype
from dmuon.kernels.cuda_graphs import graph_cache
from dmuon.kernels.symmetric_ops import TORCH_OPS, SymmetricOps

__all__ = ["execute", "graph_key", "random_wide_batch", "wants_graph"]

Iterate = Callable[[torch.Tensor, SymmetricOps], torch.Tensor]


def random_wide_batch(
    batch: int, m: int, n: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    """A reproducible ``(batch, m, n)`` Gaussian batch, each matrix at unit Frobenius norm.

    What the autotuner cross-checks and times candidates on.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    X = torch.randn(batch, m, n, generator=g, device=device, dtype=torch.float32)
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    return X.to(dtype)


def wants_graph(
    *,
    device_type: str,
    cuda_graph: bool | None,
    enabled: bool,
    capturing: bool,
    needs_grad: bool,
) -> bool:
    """Whether a call goes through the CUDA-graph cache.

    Only CUDA tensors; ``cuda_graph`` (``None`` = the process default ``enabled``);
    never inside somebody else's capture (the call then simply becomes part of that
    graph) and never when autograd records the call (a graph has no backward).
    """
    wanted = enabled if cuda_graph is None else cuda_graph
    return wanted and device_type == "cuda" and not capturing and not needs_grad


def graph_key(
    G: torch.Tensor,
    *,
    method: str,
    compute_dtype: torch.dtype,
    schedule: Schedule,
    restarts: tuple[int, ...],
    eps: float,
    ops_name: str,
) -> tuple:
    """One graph per shape, input dtype, device, compute dtype, iteration and products."""
    return (
        method,
        tuple(G.shape),
        G.dtype,
        str(G.device),
        compute_dtype,
        schedule,
        restarts,
        eps,
        ops_name,
    )


def _ops_for(
    choice: str,
    *,
    method: str,
    iterate: Iterate,
    schedule: Schedule,
    restarts: tuple[int, ...],
    device: torch.device,
    batch: int,
    m: int,
    n: int,
    compute_dtype: torch.dtype,
) -> SymmetricOps:
    if choice == "torch":
        return TORCH_OPS
    candidates = triton_candidates()
    if choice == "triton":
        return candidates["triton"]
    tuner = default_autotuner()
    key = tuner.key(device, method, batch, m, n, compute_dtype, len(schedule), restarts)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Timing synchronises the device, which a capture forbids: use what is known.
        decision = tuner.lookup(key)
        known = {TORCH_OPS.name: TORCH_OPS, **candidates}
        return known.get(decision.winner, TORCH_OPS) if decision else TORCH_OPS
    return tuner.choose(
        key,
        iterate,
        candidates,
        lambda: random_wide_batch(batch, m, n, compute_dtype, device),
    )


def execute(
    G: torch.Tensor,
    *,
    method: str,
    iterate: Iterate,
    schedule: Schedule,
    restarts: tuple[int, ...],
    eps: float,
    compute_dtype: torch.dtype | None,
    backend: str,
    cuda_graph: bool | None,
) -> torch.Tensor:
    """Normalise ``G`` to the wide orientation, run ``iterate`` with the chosen products, undo.

    See :func:`~dmuon.kernels.orthogonalize` for the backend rule and the CUDA-graph
    behaviour.
    """
    check_matrix_input(G)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be None, True or False, got {cuda_graph!r}")
    if G.numel() == 0:
        return empty_result(G)
    dtype = compute_dtype if compute_dtype is not None else default_compute_dtype(G.device, method)
    m, n = sorted(G.shape[-2:])
    batch = math.prod(G.shape[:-2])
    choice = resolve_backend(backend, device=G.device, compute_dtype=dtype, gram_size=m)
    ops = _ops_for(
        choice,
        method=method,
        iterate=iterate,
        schedule=schedule,
        restarts=restarts,
        device=G.device,
        batch=batch,
        m=m,
        n=n,
        compute_dtype=dtype,
    )

    def whole_call(G: torch.Tensor) -> torch.Tensor:
        X, layout = to_wide_normalized(G, eps, dtype, method)
        return restore(iterate(X, ops), layout)

    cache = graph_cache()
    on_cuda = G.device.type == "cuda"
    if wants_graph(
        device_type=G.device.type,
        cuda_graph=cuda_graph,
        enabled=cache.enabled,
        capturing=on_cuda and torch.cuda.is_current_stream_capturing(),
        needs_grad=G.requires_grad and torch.is_grad_enabled(),
    ):
        key = graph_key(
            G,
            method=method,
            compute_dtype=dtype,
            schedule=schedule,
            restarts=restarts,
            eps=eps,
            ops_name=ops.name,
        )
        return cache.run(key, whole_call, G, force=cuda_graph is True)
    return whole_call(G)
