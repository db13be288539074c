"""Deadlines for collectives, and errors that say which collective failed and why.

A distributed step must never hang: when a peer dies or stops answering, every
other rank should raise within a known time, saying which collective it was in.
Two facts about ``torch.distributed`` shape this module:

* an asynchronous work object's ``wait(timeout=...)`` honours the timeout on gloo
  (and NCCL), so DMuon issues its collectives with ``async_op=True`` and waits with
  the deadline of :func:`collective_timeout` (without one, the process group's own
  timeout applies, as it does for every synchronous collective);
* when a peer process dies, gloo fails the collective at once with "Connection
  closed/reset by peer [address]" — it gives the peer's socket address, not its
  rank; the ranks not connected to the dead one only run into their deadline.

:func:`wait_work` turns any failure into a :class:`CollectiveError` naming the
collective, its ranks and the deadline; :meth:`CollectiveError.after_roll_call`
names the dead (or stalled) rank by a roll call over the rendezvous store
(:mod:`dmuon.comm.roll_call`), and the optimizer adds the step.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch.distributed as dist

from dmuon.comm.roll_call import (
    DEFAULT_GRACE,
    POLL_INTERVAL,
    RollCall,
    call_roll,
    note_collective,
)

__all__ = ["CollectiveError", "collective_timeout", "current_timeout", "wait_work"]

_TIMEOUT: ContextVar[datetime.timedelta | None] = ContextVar(
    "dmuon_collective_timeout", default=None
)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, closed its connection, or did not answer in time.

    Attributes:
        what: the collective (e.g. ``"reduce to owners of layer 'blocks.1'"``).
        ranks: the global ranks of its process group.
        timeout: the deadline it was waited with, in seconds (``None``: the group's).
        reason: ``"peer_died"``, ``"timeout"`` or ``"error"``.
        dead_rank: the rank that died when it can be known (the one rank absent from
            the roll call), else ``None``.
        roll_call: what the roll call after the failure found (``None``: none made).

    Examples:
        >>> err = CollectiveError("all-reduce of flags", [0, 1], 5.0, "timeout", "timed out")
        >>> err.reason, err.ranks
        ('timeout', [0, 1])
    """

    def __init__(
        self,
        what: str,
        ranks: list[int],
        timeout: float | None,
        reason: str,
        cause: str,
        dead_rank: int | None = None,
        context: str = "",
        roll_call: RollCall | None = None,
    ) -> None:
        self.what, self.ranks, self.timeout = what, ranks, timeout
        self.reason, self.cause, self.dead_rank, self.context = reason, cause, dead_rank, context
        self.roll_call = roll_call
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.context}: " if self.context else ""
        limit = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
        if self.reason == "peer_died":
            who = (
                f"rank {self.dead_rank}"
                if self.dead_rank is not None
                else "a peer rank (gloo names only its address: " + _peer(self.cause) + ")"
            )
            why = f"{who} closed its connection — the process died or exited"
        elif self.reason == "timeout":
            why = (
                f"no answer within {limit}: a rank of the group stopped (hung, killed, or "
                "waiting in a different collective)"
            )
        else:
            why = "the collective raised"
        roll = f" {_capital(self.roll_call.summary())}." if self.roll_call is not None else ""
        return (
            f"{where}{self.what} over ranks {self.ranks} failed: {why}.{roll} "
            f"Original error: {self.cause.strip().splitlines()[0] if self.cause.strip() else '?'}"
        )

    def _replace(self, **changes: Any) -> CollectiveError:
        fields = {
            "what": self.what,
            "ranks": self.ranks,
            "timeout": self.timeout,
            "reason": self.reason,
            "cause": self.cause,
            "dead_rank": self.dead_rank,
            "context": self.context,
            "roll_call": self.roll_call,
        }
        return CollectiveError(**{**fields, **changes})

    def with_context(self, context: str) -> CollectiveError:
        """The same error with ``context`` (e.g. the step) in front of the message."""
        return self._replace(context=context)

    def after_roll_call(self, grace: float | None = None) -> CollectiveError:
        """The same error, with the ranks of its group that did not answer a roll call
        named (:func:`dmuon.comm.roll_call.call_roll`); unchanged if one was made.

        Args:
            grace: seconds to wait for answers (``None``: 1 s, at most half the deadline
                but at least three of the responders' polling intervals).

        Examples:
            >>> from dmuon.comm.roll_call import stop_responder
            >>> stop_responder()
            >>> err = CollectiveError("broadcast", [0, 1], 2.0, "timeout", "timed out")
            >>> err.after_roll_call().roll_call.unavailable is not None
            True
        """
        if self.roll_call is not None or not self.ranks:
            return self
        if grace is None:
            grace = DEFAULT_GRACE if self.timeout is None else min(DEFAULT_GRACE, self.timeout / 2)
            grace = max(grace, 3 * POLL_INTERVAL)
        roll = call_roll(self.ranks, grace)
        dead = self.dead_rank
        if dead is None and len(roll.absent) == 1:
            dead = roll.absent[0]
        return self._replace(roll_call=roll, dead_rank=dead)


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _peer(text: str) -> str:
    m = re.search(r"\[[^\]]*\]:\d+", text)
    return m.group(0) if m else "unknown"


@contextlib.contextmanager
def collective_timeout(seconds: float | None) -> Iterator[None]:
    """Wait every collective of :func:`wait_work` at most ``seconds`` inside the block.

    ``None`` keeps the process group's timeout.

    Examples:
        >>> with collective_timeout(5):
        ...     current_timeout()
        5.0
        >>> current_timeout() is None
        True
    """
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {seconds!r}")
    value = None if seconds is None else datetime.timedelta(seconds=float(seconds))
    token = _TIMEOUT.set(value)
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def current_timeout() -> float | None:
    """The deadline of the enclosing :func:`collective_timeout` in seconds (``None``: none).

    Examples:
        >>> current_timeout() is None
        True
    """
    t = _TIMEOUT.get()
    return None if t is None else t.total_seconds()


def _ranks(group: Any) -> list[int]:
    try:
        if group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(group))
    except Exception:
        return []


def classify(exc: BaseException) -> str:
    """``"peer_died"``, ``"timeout"`` or ``"error"`` for an exception a collective raised.

    Examples:
        >>> classify(RuntimeError("Connection closed by peer [127.0.0.1]:4242"))
        'peer_died'
    """
    text = str(exc)
    if re.search(r"Connection (closed|reset) by peer|Broken pipe|Connection refused", text):
        return "peer_died"
    if re.search(r"timed out|Timeout|timeout", text):
        return "timeout"
    return "error"


def wait_work(work: Any, what: str, group: Any = None) -> None:
    """Wait for a ``torch.distributed`` work object within the current deadline.

    Args:
        work: what ``dist.<collective>(..., async_op=True)`` returned (``None``: nothing).
        what: the collective, for the error message.
        group: its process group (``None``: the world), for the error message.

    Raises:
        CollectiveError: the collective failed or did not finish within the deadline.

    Examples:
        >>> wait_work(None, "nothing")
    """
    if work is None:
        return
    timeout = _TIMEOUT.get()
    note_collective(what)  # what a roll call reports of this rank while it waits
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timeout)
        note_collective(None)  # left in place on failure: this rank was waiting in it
    except CollectiveError:
        raise
    except Exception as exc:  # gloo raises plain RuntimeError / DistBackendError
        raise failure(exc, what, group) from exc


def failure(exc: BaseException, what: str, group: Any = None) -> CollectiveError:
    """The :class:`CollectiveError` for ``exc`` raised by collective ``what``.

    Examples:
        >>> failure(RuntimeError("Operation timed out!"), "broadcast").reason
        'timeout'
    """
    if isinstance(exc, CollectiveError):
        return exc
    return CollectiveError(what, _ranks(group), current_timeout(), classify(exc), str(exc))
