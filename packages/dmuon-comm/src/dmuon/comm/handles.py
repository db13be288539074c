"""Handles of started communication: wait for the result when you need it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from dmuon.comm.faults import wait_work

__all__ = ["CommHandle"]

T = TypeVar("T")


class CommHandle(Generic[T]):
    """A communication that has been started; :meth:`wait` finishes it and gives its result.

    Wraps the ``torch.distributed`` work objects of one wrapper call and a
    ``finish`` step that runs after they complete (divide by the world size, run
    the second stage of an HSDP reduction, copy results out). ``wait`` is
    idempotent: later calls return the same result. Holding the handle keeps the
    communication buffers alive, so drop it only after waiting.

    Examples:
        >>> h = CommHandle([], lambda: 42)
        >>> h.is_completed(), h.wait(), h.wait()
        (True, 42, 42)
    """

    def __init__(
        self,
        works: Sequence[Any],
        finish: Callable[[], T],
        *,
        what: str = "communication",
        group: Any = None,
        device: Any = None,
    ):
        self._works = [w for w in works if w is not None]
        self.what = what
        self._group = group
        # where the result is used next (kernels, not a host read): see wait_work
        self._device = device
        self._finish: Callable[[], T] | None = finish
        self._result: T | None = None

    def is_completed(self) -> bool:
        """True when every started collective has completed (``wait`` will not block on them)."""
        return all(w.is_completed() for w in self._works)

    def wait(self) -> T:
        """Block until the communication is done and return its result.

        Each collective is waited within :func:`dmuon.comm.collective_timeout`'s deadline
        (default: the process group's timeout).

        Raises:
            dmuon.comm.CollectiveError: a collective failed or missed the deadline.
        """
        if self._finish is not None:
            for w in self._works:
                wait_work(w, self.what, self._group, device=self._device)
            finish, self._finish = self._finish, None
            self._result = finish()
            self._works = []
        return self._result  # type: ignore[return-value]

    @classmethod
    def done(cls, result: T) -> CommHandle[T]:
        """A handle that is already complete (e.g. nothing to communicate).

        Examples:
            >>> CommHandle.done({"w": 1}).wait()
            {'w': 1}
        """
        return cls([], lambda: result)
