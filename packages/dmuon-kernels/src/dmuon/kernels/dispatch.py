"""One Newton–Schulz call end to end: plan, backend, autotune, CUDA graph, preparation, way back.

Every public entry point (:func:`~dmuon.kernels.orthogonalize`,
:func:`~dmuon.kernels.newton_schulz`, :func:`~dmuon.kernels.gram_newton_schulz`)
hands its iteration and its :class:`~dmuon.kernels.ns_options.NSOptions` to
:func:`run`; this module decides which :class:`~dmuon.kernels.SymmetricOps` the
iteration runs with and whether the whole call goes through a CUDA graph. It knows
nothing about the iterations themselves.

**Plans.** An optimizer calls with the same options on the same shapes every step,
and everything decided before the first matmul — the checked coefficient schedule
and restarts, the compute dtype, the backend rule's answer — depends only on the
options, the device and the Gram size. :func:`run` resolves it once into a frozen
:class:`CallPlan` and reuses it, so a warm call goes from the entry point straight
to its iteration and the products (the same arithmetic in the same order: results
are bitwise those of a fresh resolution). What can change between calls is decided
per call as before: the autotuner's answer (``backend="auto"`` on CUDA), the CUDA-
graph switch and whether a capture is running.

**Processes that must agree.** The autotuner times candidates in each process, so
two processes running the same call may pick different products (and Triton's own
tile autotuning different tiles), whose results differ by rounding (about 2e-3
relative after a Gram call on an H200). Where several processes compute the same
orthogonalisation and must hold bitwise-equal results (replicas of one model),
:func:`without_autotuning` makes ``"auto"`` take the torch products, untimed.

**Devices.** A CUDA call runs with its tensor's device current
(``torch.cuda.device``): the autotuner's timing, the Triton launches and the CUDA
graph's capture and replay all use the current device's stream, which need not be
the tensor's.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dmuon.kernels._layout import check_matrix_input, empty_result, restore, to_wide_normalized
from dmuon.kernels.autotune import default_autotuner
from dmuon.kernels.backends import BACKENDS, resolve_backend, triton_candidates
from dmuon.kernels.coefficients import Schedule
from dmuon.kernels.compute_dtype import default_compute_dtype
from dmuon.kernels.cuda_graphs import graph_cache
from dmuon.kernels.ns_options import NSOptions, default_restarts
from dmuon.kernels.symmetric_ops import TORCH_OPS, SymmetricOps

__all__ = [
    "CallPlan",
    "Iteration",
    "autotuning_allowed",
    "graph_key",
    "random_wide_batch",
    "run",
    "wants_graph",
    "without_autotuning",
]

Iterate = Callable[[torch.Tensor, SymmetricOps], torch.Tensor]
Iteration = Callable[[torch.Tensor, Schedule, tuple[int, ...], SymmetricOps], torch.Tensor]
"""An iteration as :func:`run` calls it: ``(X, schedule, restarts, ops) -> X``."""


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


@dataclass(frozen=True)
class CallPlan:
    """What every call with the same options, method, device and Gram size does.

    Attributes:
        method: ``"gram"`` or ``"standard"`` (part of the graph and tuning keys).
        iterate: the iteration bound to ``schedule`` and ``restarts``, ``(X, ops) -> X``.
        schedule: the checked ``(a, b, c)`` triples, one per step.
        restarts: the checked Gram restarts (``()`` for the standard iteration).
        eps: relative guard of the normalisation.
        compute_dtype: the dtype of the matmuls (the per-device default resolved).
        ops: the symmetric products, or ``None`` when the per-shape autotuner
            chooses them on each call (``backend="auto"`` where Triton can help).
    """

    method: str
    iterate: Iterate
    schedule: Schedule
    restarts: tuple[int, ...]
    eps: float
    compute_dtype: torch.dtype
    ops: SymmetricOps | None


_PLANS: dict[tuple, CallPlan] = {}


def _plan_key(G: object, method: str, iteration: Iteration, options: NSOptions) -> tuple | None:
    """The key of the plan a call can reuse, or None when it must be resolved afresh.

    Only plain options are keyed: a name of coefficients, int steps and restarts, a
    float eps. ``True == 1`` and ``(2.0,) == (2,)`` in a key, so anything else goes
    through the checks every time (and raises there when it is wrong). The backend
    rule itself is part of the key, so a replaced rule (tests replace it) is never
    answered from a plan that another rule made.
    """
    o = options
    restarts = o.restarts
    if type(restarts) in (tuple, list):
        restarts = tuple(restarts)  # type: ignore[arg-type]
    plain = (
        isinstance(G, torch.Tensor)
        and G.ndim >= 2
        and type(method) is str
        and type(o.coefficients) is str
        and type(o.steps) is int
        and (restarts is None or (type(restarts) is tuple and set(map(type, restarts)) <= {int}))
        and type(o.eps) is float
        and (o.compute_dtype is None or isinstance(o.compute_dtype, torch.dtype))
        and type(o.backend) is str
    )
    if not plain:
        return None
    assert isinstance(G, torch.Tensor)
    gram_size = min(G.shape[-2:])
    return (method, iteration, o.coefficients, o.steps, restarts, o.eps, o.compute_dtype,
            o.backend, G.device, gram_size, resolve_backend)  # fmt: skip


def _make_plan(
    G: torch.Tensor,
    method: str,
    iteration: Iteration,
    options: NSOptions,
    schedule: Schedule,
    restarts: tuple[int, ...] | None,
) -> CallPlan:
    dtype = (
        options.compute_dtype
        if options.compute_dtype is not None
        else default_compute_dtype(G.device, method)
    )
    if restarts is None:
        restarts = default_restarts(len(schedule), dtype) if method == "gram" else ()
    choice = resolve_backend(
        options.backend, device=G.device, compute_dtype=dtype, gram_size=min(G.shape[-2:])
    )
    ops: SymmetricOps | None = None  # "tune": the autotuner answers per call
    if choice == "torch":
        ops = TORCH_OPS
    elif choice == "triton":
        ops = triton_candidates()["triton"]

    def iterate(X: torch.Tensor, ops: SymmetricOps) -> torch.Tensor:
        return iteration(X, schedule, restarts, ops)

    return CallPlan(method, iterate, schedule, restarts, options.eps, dtype, ops)


_UNTUNED: contextvars.ContextVar[bool] = contextvars.ContextVar("dmuon_untuned", default=False)


@contextlib.contextmanager
def without_autotuning() -> Iterator[None]:
    """Inside it, ``backend="auto"`` takes the torch products without asking the autotuner.

    The autotuner times its candidates in each process, and its answer (and Triton's
    choice of tiles) may differ between processes on the same problem: their results
    then differ by rounding. Processes that compute the same orthogonalisation and
    must agree bitwise — the ranks of ``single`` mode under DDP, each repeating the
    whole step — run it inside this context, where the choice depends on nothing
    timed. An explicit ``backend="triton"`` is still honoured (the caller chose it on
    every process alike). Nests; restores the previous setting on exit.

    Examples:
        >>> import torch
        >>> from dmuon.kernels import orthogonalize
        >>> from dmuon.kernels.dispatch import autotuning_allowed, without_autotuning
        >>> with without_autotuning():
        ...     O = orthogonalize(torch.randn(8, 16))
        ...     autotuning_allowed()
        False
        >>> autotuning_allowed()
        True
    """
    token = _UNTUNED.set(True)
    try:
        yield
    finally:
        _UNTUNED.reset(token)


def autotuning_allowed() -> bool:
    """False inside :func:`without_autotuning`: ``backend="auto"`` then takes the torch products.

    Examples:
        >>> from dmuon.kernels.dispatch import autotuning_allowed
        >>> autotuning_allowed()
        True
    """
    return not _UNTUNED.get()


def _tuned_ops(G: torch.Tensor, plan: CallPlan) -> SymmetricOps:
    """The autotuner's products for this shape (timed the first time it is seen)."""
    candidates = triton_candidates()
    m, n = sorted(G.shape[-2:])
    batch = math.prod(G.shape[:-2])
    dtype, device = plan.compute_dtype, G.device
    tuner = default_autotuner()
    key = tuner.key(device, plan.method, batch, m, n, dtype, len(plan.schedule), plan.restarts)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Timing synchronises the device, which a capture forbids: use what is known.
        decision = tuner.lookup(key)
        known = {TORCH_OPS.name: TORCH_OPS, **candidates}
        return known.get(decision.winner, TORCH_OPS) if decision else TORCH_OPS
    return tuner.choose(
        key,
        plan.iterate,
        candidates,
        lambda: random_wide_batch(batch, m, n, dtype, device),
    )


def run(G: torch.Tensor, method: str, iteration: Iteration, options: NSOptions) -> torch.Tensor:
    """Normalise ``G`` to the wide orientation, run ``iteration`` with the chosen products, undo.

    See :func:`~dmuon.kernels.orthogonalize` for the options, the backend rule and
    the CUDA-graph behaviour. The checks run in the order they always have
    (options, then ``G``, ``backend`` and ``cuda_graph``); a call with a plan has
    passed the checks of its options already.
    """
    key = _plan_key(G, method, iteration, options)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        schedule, restarts = options.resolve(method)
    check_matrix_input(G)
    if plan is None and options.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {options.backend!r}")
    cuda_graph = options.cuda_graph
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be None, True or False, got {cuda_graph!r}")
    if G.numel() == 0:
        return empty_result(G)
    if plan is None:
        plan = _make_plan(G, method, iteration, options, schedule, restarts)
        if key is not None:
            _PLANS[key] = plan
    if G.device.type != "cuda":
        # graphs are CUDA-only: the cache is not even asked
        return _whole_call(G, plan, _ops(G, plan))
    # the tensor's device current: timing, Triton launches and a graph's capture and
    # replay use the current device's stream, which need not be the tensor's
    with torch.cuda.device(G.device):
        return _run_cuda(G, plan, _ops(G, plan), cuda_graph)


def _ops(G: torch.Tensor, plan: CallPlan) -> SymmetricOps:
    """The plan's products; ``"auto"`` on CUDA asks the autotuner, unless it is switched
    off (:func:`without_autotuning`) and the torch products are taken."""
    if plan.ops is not None:
        return plan.ops
    return _tuned_ops(G, plan) if autotuning_allowed() else TORCH_OPS


def _whole_call(G: torch.Tensor, plan: CallPlan, ops: SymmetricOps) -> torch.Tensor:
    # CPU, torch products: a tall matrix is iterated in its own layout (no transpose
    # in memory, see to_wide_normalized); the Triton kernels and CUDA take it wide.
    in_place = ops is TORCH_OPS and G.device.type == "cpu"
    X, layout = to_wide_normalized(
        G, plan.eps, plan.compute_dtype, plan.method, tall_in_place=in_place
    )
    return restore(plan.iterate(X, ops), layout)


def _run_cuda(
    G: torch.Tensor, plan: CallPlan, ops: SymmetricOps, cuda_graph: bool | None
) -> torch.Tensor:
    """A CUDA call (``G``'s device current): through the graph cache when it wants one."""
    cache = graph_cache()
    if wants_graph(
        device_type=G.device.type,
        cuda_graph=cuda_graph,
        enabled=cache.enabled,
        capturing=torch.cuda.is_current_stream_capturing(),
        needs_grad=G.requires_grad and torch.is_grad_enabled(),
    ):
        key = graph_key(
            G,
            method=plan.method,
            compute_dtype=plan.compute_dtype,
            schedule=plan.schedule,
            restarts=plan.restarts,
            eps=plan.eps,
            ops_name=ops.name,
        )

        def whole_call(X: torch.Tensor) -> torch.Tensor:
            return _whole_call(X, plan, ops)

        return cache.run(key, whole_call, G, force=cuda_graph is True)
    return _whole_call(G, plan, ops)
