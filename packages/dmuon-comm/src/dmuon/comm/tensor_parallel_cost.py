"""Which way to orthogonalise a tensor-parallel matrix: on its shards, or gathered.

A matrix ``m × n`` split along one dimension over ``t`` ranks can be orthogonalised
two ways (the DMuon issue's paths (a) and (b)):

* **Gram path** (:func:`dmuon.kernels.tp_gram_newton_schulz`): the small Gram matrix
  of the unsplit side ``g`` (``n`` for a row split, ``m`` for a column split) is
  all-reduced over the group at the start and at each of ``r`` restarts; each rank
  multiplies only its shard. Per rank, with ``l = ⌈L/t⌉`` the largest shard of the
  split side ``L``::

      flops = 4(1 + r)·g²·l + (8·steps − 6 − 6r)·g³
      comm  = (1 + r) all-reduces of b·g² elements, and the normalisation's two:
              b maxima, then b squared norms and the split size (b + 1)

  The Gram matrices travel in the Newton–Schulz compute dtype (``gram_element_size``:
  fp16's 2 bytes on a GPU by default, :func:`dmuon.kernels.default_compute_dtype`); the
  normalisation's ``b`` and ``b + 1`` entries in fp32 (:data:`NORMALISATION_ELEMENT_SIZE`:
  the kernel normalises in fp32 before the cast down, in fp64 for fp64 shards).

  The kernel restarts at step 2 when ``g`` is the short side of the whole matrix, and
  at every step when it is the long side (its exactness needs it), so the Gram path
  is cheap exactly when the unsplit side is the short one.
* **Gather path**: one all-gather of the shards (``m·n`` elements out), and every rank
  runs the ordinary Newton–Schulz on the whole matrix and keeps its shard::

      flops = ns_flops(m, n)          (not divided by t)
      comm  = one all-gather of m·n elements

  The shards travel in the dtype of the rule's chain (``gather_element_size``: the
  parameter's, or fp32 under ``state_dtype``), not the compute dtype.

Each is priced as ``flops / flops_per_second`` plus the α–β time of its collectives
(:func:`~dmuon.comm.cost_model`); :func:`tensor_parallel_path` picks the cheaper.
Every rank of the group computes the same choice from the same whole shape, so the
ranks never disagree on which collectives follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmuon.comm.cost import NSCost
from dmuon.comm.cost_model import DEFAULT_ALPHA, DEFAULT_BANDWIDTH, cost_model
from dmuon.comm.flops import ns_flops

__all__ = [
    "NORMALISATION_ELEMENT_SIZE",
    "TensorParallelPath",
    "gram_restarts",
    "tensor_parallel_path",
]

NORMALISATION_ELEMENT_SIZE = 4
"""Bytes per entry of the Gram path's two normalisation all-reduces (the batch's maxima,
then its squared norms with the split size appended): fp32, what
:func:`dmuon.kernels.tp_gram_newton_schulz` normalises in (fp64 shards: 8)."""


@dataclass(frozen=True)
class TensorParallelPath:
    """The cheaper way to orthogonalise a split matrix, with both prices.

    Attributes:
        path: ``"gram"`` or ``"gather"``.
        gram_seconds: predicted seconds of the Gram path (per rank, the whole batch).
        gather_seconds: predicted seconds of the gather path.
        gram_bytes: bytes each rank sends on the Gram path.
        gather_bytes: bytes each rank sends on the gather path.

    Examples:
        >>> choice = tensor_parallel_path(2048, 8192, -1, 8)  # rowwise down-projection
        >>> choice.path, choice.gram_bytes > choice.gather_bytes  # more bytes, 1/8 of the work
        ('gram', True)
    """

    path: str
    gram_seconds: float
    gather_seconds: float
    gram_bytes: float
    gather_bytes: float


def gram_restarts(m: int, n: int, split_dim: int, steps: int) -> tuple[int, ...]:
    """The restarts :func:`dmuon.kernels.tp_gram_newton_schulz` uses by default: one,
    ``(2,)``, when the unsplit side is the short side of the whole matrix, every step
    otherwise. (In bf16 the kernel takes its one restart at 3; the cost, which counts
    restarts, is the same.)

    Examples:
        >>> gram_restarts(4096, 1024, -2, 5)  # rows split: Gram side 1024, the short one
        (2,)
        >>> gram_restarts(1024, 4096, -2, 5)  # Gram side 4096, the long one
        (1, 2, 3, 4)
    """
    g, split = (n, m) if split_dim in (-2, 0) else (m, n)
    if g <= split:
        return (2,) if steps > 2 else ()
    return tuple(range(1, steps))


def tensor_parallel_path(
    m: int,
    n: int,
    split_dim: int,
    world_size: int,
    *,
    element_size: int = 4,
    gram_element_size: int | None = None,
    gather_element_size: int | None = None,
    batch: int = 1,
    method: str = "gram",
    steps: int = 5,
    flops_per_second: float = NSCost.flops_per_second,
    alpha: float = DEFAULT_ALPHA,
    bandwidth: float = DEFAULT_BANDWIDTH,
) -> TensorParallelPath:
    """The cheaper path for ``batch`` matrices ``m × n`` split along ``split_dim`` (``-2``
    rows, ``-1`` columns) over ``world_size`` ranks (see the module docstring).

    Args:
        m: whole rows.
        n: whole columns.
        split_dim: ``-2`` (rows split) or ``-1`` (columns split).
        world_size: ranks of the tensor-parallel group.
        element_size: bytes per element of what travels, on both paths unless one of
            the two below is given.
        gram_element_size: bytes per element of the Gram matrices the Gram path
            all-reduces: the Newton–Schulz compute dtype's (default ``element_size``).
        gather_element_size: bytes per element of the shards the gather path
            all-gathers: the dtype of the rule's chain (default ``element_size``).
        batch: matrices stepped together.
        method: the Newton–Schulz method the gather path runs on the whole matrix.
        steps: Newton–Schulz steps.
        flops_per_second: sustained matrix-product rate (default: :class:`~dmuon.comm.NSCost`'s).
        alpha: latency per collective step (default: :func:`~dmuon.comm.cost_model`'s).
        bandwidth: bytes per second of one link (default: :func:`~dmuon.comm.cost_model`'s).

    Raises:
        ValueError: a split dimension other than rows or columns, or sizes below 1.

    Examples:
        >>> tensor_parallel_path(4096, 1024, -2, 4).path  # MLP up-projection, colwise
        'gram'
        >>> tensor_parallel_path(1024, 4096, -2, 4).path  # the unsplit side is the long one
        'gather'
        >>> fp16 = tensor_parallel_path(4096, 1024, -2, 4, gram_element_size=2)  # fp16 Gram
        >>> fp32 = tensor_parallel_path(4096, 1024, -2, 4)
        >>> fp16.gram_bytes < fp32.gram_bytes, fp16.gather_bytes == fp32.gather_bytes
        (True, True)
    """
    if split_dim not in (-2, -1):
        raise ValueError(f"split_dim must be -2 (rows) or -1 (columns), got {split_dim!r}")
    gram_e = element_size if gram_element_size is None else gram_element_size
    gather_e = element_size if gather_element_size is None else gather_element_size
    if min(m, n, world_size, batch, element_size, gram_e, gather_e) < 1:
        raise ValueError(
            f"m, n, world_size, batch and the element sizes must be ≥ 1, got m={m}, n={n}, "
            f"world_size={world_size}, batch={batch}, element_size={element_size}, "
            f"gram_element_size={gram_element_size}, gather_element_size={gather_element_size}"
        )
    g, split = (n, m) if split_dim == -2 else (m, n)
    local = -(-split // world_size)
    restarts = gram_restarts(m, n, split_dim, steps)
    r = len(restarts)
    gram_flops = batch * (4 * (1 + r) * g * g * local + max(8 * steps - 6 - 6 * r, 0) * g**3)
    reduce = cost_model(
        "all_reduce", batch * g * g * gram_e, world_size, alpha=alpha, bandwidth=bandwidth
    )
    # the normalisation: one all-reduce of the batch's maxima, one of its squared norms
    # with the split size appended (b and b + 1 fp32 entries)
    e = NORMALISATION_ELEMENT_SIZE
    maxima = cost_model("all_reduce", batch * e, world_size, alpha=alpha, bandwidth=bandwidth)
    norms = cost_model("all_reduce", (batch + 1) * e, world_size, alpha=alpha, bandwidth=bandwidth)
    gram_seconds = (
        gram_flops / flops_per_second + (1 + r) * reduce.seconds + maxima.seconds + norms.seconds
    )
    gram_bytes = (1 + r) * reduce.bytes_sent + maxima.bytes_sent + norms.bytes_sent
    whole_flops = ns_flops(m, n, method=method, steps=steps, batch=batch)
    gather = cost_model(
        "all_gather", batch * m * n * gather_e, world_size, alpha=alpha, bandwidth=bandwidth
    )
    gather_seconds = whole_flops / flops_per_second + gather.seconds
    path = "gather" if gather_seconds < gram_seconds else "gram"
    return TensorParallelPath(path, gram_seconds, gather_seconds, gram_bytes, gather.bytes_sent)
