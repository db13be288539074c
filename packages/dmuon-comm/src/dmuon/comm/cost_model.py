"""α–β model of the collectives: predicted time and per-rank bytes.

A message of ``B`` bytes over a link costs ``α + β·B`` (Hockney 1994): ``α`` is
the start-up latency, ``β = 1/bandwidth``. Each collective on ``N`` ranks is
charged the latency steps and the per-rank traffic of its bandwidth-optimal
algorithm (Thakur, Rabenseifner & Gropp, *Optimization of Collective
Communication Operations in MPICH*, 2005; Chan et al. 2007):

| op | latency steps | bytes sent = received, per rank |
|---|---|---|
| ``all_reduce`` (ring) | ``2(N−1)`` | ``2(N−1)/N · B`` |
| ``reduce``, ``broadcast`` (pipelined chain) | ``N−1`` | ``(N−1)/N · B`` |
| ``all_gather`` (ring; ``B`` = output) | ``N−1`` | ``(N−1)/N · B`` |
| ``reduce_scatter`` (ring; ``B`` = input) | ``N−1`` | ``(N−1)/N · B`` |
| ``all_to_all`` (pairwise; ``B`` = input) | ``N−1`` | ``(N−1)/N · B`` if balanced |

For rooted ops the figure is the per-rank *average*: a chain moves ``(N−1)·B``
bytes in all, and when every rank is the root of its own share of the data (the
owner pattern) every rank carries that average. With it, reducing every matrix
to its owner and broadcasting it back costs ``2(N−1)/N · P`` bytes per rank, the
same as one ring all-reduce of all ``P`` bytes (DMuon's claim). For ``all_to_all``
with uneven splits the wrappers record each rank's exact off-rank bytes.

The predicted time is ``steps·α + β·max(sent, received)``; it is what the
benchmark puts next to the measured time.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLLECTIVES", "CollectiveCost", "cost_model"]

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
"""Collectives :func:`cost_model` can predict (α–β time and per-rank bytes)."""

# Defaults: α of a GPU collective launch, bandwidth of one intra-node NVLink-class
# link. Benchmarks fit both to the machine they run on.
DEFAULT_ALPHA = 10e-6
DEFAULT_BANDWIDTH = 100e9


@dataclass(frozen=True)
class CollectiveCost:
    """The α–β prediction for one collective.

    Attributes:
        op: collective name (one of :data:`COLLECTIVES`).
        world_size: ranks in the group.
        nbytes: message size ``B`` as defined per op (see the module table).
        steps: latency steps of the algorithm.
        bytes_sent: bytes each rank sends (average over ranks for rooted ops).
        bytes_received: bytes each rank receives.
        seconds: ``steps·α + max(bytes_sent, bytes_received)/bandwidth``.

    Examples:
        >>> c = cost_model("all_reduce", 4 * 2**20, 8, alpha=1e-5, bandwidth=1e10)
        >>> c.bytes_sent == 2 * 7 / 8 * 4 * 2**20, round(c.seconds * 1e3, 3)
        (True, 0.874)
    """

    op: str
    world_size: int
    nbytes: int
    steps: int
    bytes_sent: float
    bytes_received: float
    seconds: float


def cost_model(
    op: str,
    nbytes: int,
    world_size: int,
    *,
    alpha: float = DEFAULT_ALPHA,
    bandwidth: float = DEFAULT_BANDWIDTH,
) -> CollectiveCost:
    """α–β prediction of the time and per-rank bytes of one collective.

    See the module docstring for the algorithm behind each op and what ``nbytes``
    means for it (for ``all_gather`` the gathered output, for ``reduce_scatter``
    and ``all_to_all`` the per-rank input). With one rank nothing moves.

    Args:
        op: one of :data:`COLLECTIVES`.
        nbytes: message size ``B`` in bytes (≥ 0).
        world_size: ranks ``N`` (≥ 1).
        alpha: latency per step, seconds.
        bandwidth: bytes per second of one link (``1/β``).

    Raises:
        ValueError: unknown ``op``, negative ``nbytes``, ``world_size < 1`` or a
            non-positive ``alpha``/``bandwidth``.

    Examples:
        >>> P = 100 * 2**20
        >>> owner = cost_model("reduce", P, 4).bytes_sent + cost_model("broadcast", P, 4).bytes_sent
        >>> owner == cost_model("all_reduce", P, 4).bytes_sent  # one ring all-reduce
        True
    """
    if op not in COLLECTIVES:
        raise ValueError(f"op must be one of {COLLECTIVES}, got {op!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int ≥ 0, got {nbytes!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int ≥ 1, got {world_size!r}")
    if not alpha >= 0 or not bandwidth > 0:
        raise ValueError(f"alpha must be ≥ 0 and bandwidth > 0, got {alpha!r}, {bandwidth!r}")
    N = world_size
    if N == 1:
        return CollectiveCost(op, N, nbytes, 0, 0.0, 0.0, 0.0)
    factor = 2.0 if op == "all_reduce" else 1.0
    steps = (2 if op == "all_reduce" else 1) * (N - 1)
    moved = factor * (N - 1) / N * nbytes
    return CollectiveCost(op, N, nbytes, steps, moved, moved, steps * alpha + moved / bandwidth)
