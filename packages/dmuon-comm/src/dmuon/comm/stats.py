"""Byte accounting: what every communication wrapper moved, per op."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

from dmuon.comm.cost_model import cost_model

__all__ = ["CommStats", "OpStats", "default_stats"]


@dataclass
class OpStats:
    """Counters of one wrapper (e.g. ``"reduce_to_owners"``) on this rank.

    Attributes:
        calls: wrapper invocations.
        collectives: torch.distributed collectives issued.
        payload_bytes: bytes of the buffers handed to those collectives (this rank's
            input; padding included).
        bytes_sent: bytes this rank sends, by the per-op convention of
            :func:`~dmuon.comm.cost_model` (average over ranks for rooted ops, exact
            off-rank bytes for all-to-all).
        bytes_received: bytes this rank receives, same convention.

    Examples:
        >>> OpStats(calls=1, collectives=2, payload_bytes=8, bytes_sent=4.0, bytes_received=4.0)
        OpStats(calls=1, collectives=2, payload_bytes=8, bytes_sent=4.0, bytes_received=4.0)
    """

    calls: int = 0
    collectives: int = 0
    payload_bytes: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0


class CommStats:
    """Bytes sent and received per op; read it, reset it, pass it to any wrapper.

    Every wrapper of this package takes ``stats=``; without it they record into
    :func:`default_stats`. Recording is thread-safe.

    Examples:
        >>> stats = CommStats()
        >>> stats.record_collective("reduce_to_owners", "reduce", nbytes=1024, world_size=4)
        >>> stats["reduce_to_owners"].bytes_sent  # (N−1)/N · B
        768.0
        >>> stats.total_bytes_sent
        768.0
        >>> stats.reset(); stats.total_bytes_sent
        0.0
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, OpStats] = {}

    def __getitem__(self, name: str) -> OpStats:
        """The counters of wrapper ``name`` (zeros if it never ran)."""
        with self._lock:
            found = self._ops.get(name)
            return OpStats(**vars(found)) if found else OpStats()

    def __contains__(self, name: object) -> bool:
        return name in self._ops

    @property
    def ops(self) -> dict[str, OpStats]:
        """A copy of all counters, by wrapper name."""
        with self._lock:
            return {k: OpStats(**vars(v)) for k, v in self._ops.items()}

    @property
    def total_bytes_sent(self) -> float:
        """Bytes sent over all ops."""
        return sum((s.bytes_sent for s in self.ops.values()), 0.0)

    @property
    def total_bytes_received(self) -> float:
        """Bytes received over all ops."""
        return sum((s.bytes_received for s in self.ops.values()), 0.0)

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self._ops.clear()

    def as_dict(self) -> dict[str, dict[str, float]]:
        """Plain ``{op: {counter: value}}`` for JSON."""
        return {k: dict(vars(v)) for k, v in self.ops.items()}

    def record(
        self,
        name: str,
        *,
        collectives: int,
        payload_bytes: int,
        bytes_sent: float,
        bytes_received: float,
        calls: int = 1,
    ) -> None:
        """Add to the counters of ``name``."""
        with self._lock:
            s = self._ops.setdefault(name, OpStats())
            s.calls += calls
            s.collectives += collectives
            s.payload_bytes += payload_bytes
            s.bytes_sent += bytes_sent
            s.bytes_received += bytes_received

    def record_collective(self, name: str, op: str, *, nbytes: int, world_size: int) -> None:
        """Add one collective ``op`` with a ``nbytes`` input buffer on this rank.

        Traffic follows :func:`~dmuon.comm.cost_model`; for ``all_gather`` the message
        size there is the gathered output, ``world_size`` times the input. Wrapper
        invocations are counted separately, by :meth:`count_call`.
        """
        size = nbytes * world_size if op == "all_gather" else nbytes
        sent, received = _traffic(op, size, world_size)
        self.record(
            name,
            collectives=1,
            payload_bytes=nbytes,
            bytes_sent=sent,
            bytes_received=received,
            calls=0,
        )

    def count_call(self, name: str) -> None:
        """Count one wrapper invocation without traffic."""
        self.record(name, collectives=0, payload_bytes=0, bytes_sent=0.0, bytes_received=0.0)


@functools.lru_cache(maxsize=4096, typed=True)
def _traffic(op: str, nbytes: int, world_size: int) -> tuple[float, float]:
    """Per-rank bytes sent and received of one collective, by :func:`~dmuon.comm.cost_model`.

    A training step issues the same collectives on the same buffers every step, so
    the figures are computed once per (op, size, world size) and looked up after.
    ``typed``: ``True`` and ``1`` are different keys (``cost_model`` rejects a bool
    size); an argument it rejects raises every time, since errors are not cached.
    """
    c = cost_model(op, nbytes, world_size)
    return c.bytes_sent, c.bytes_received


_DEFAULT = CommStats()


def default_stats() -> CommStats:
    """The process-wide :class:`CommStats` wrappers record into when given no ``stats``.

    Examples:
        >>> default_stats().reset()
    """
    return _DEFAULT
