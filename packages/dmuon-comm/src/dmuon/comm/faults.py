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
  rank; the ranks not connected to the dead one only run into their deadline;
* on NCCL, ``wait(timeout=...)`` *blocks the host* until the collective is done,
  while ``wait()`` only makes the current CUDA stream wait for it and returns at
  once. A timed wait there would drain the GPU queue at every collective (several
  per layer and step) and defeat the overlap DMuon is built for. So on a group whose
  backend waits on the stream (:func:`stream_waits`), :func:`wait_work` makes the
  stream wait and records the work with the deadline in force; :func:`settle`
  checks every recorded work before the step reads a collective's result on the
  host (the agreement's flags) — non-blocking polls of ``is_completed()`` — and
  raises the same :class:`CollectiveError` for the first one past its deadline.
  Between two such reads (e.g. inside a forward) NCCL's own process-group timeout
  and watchdog are the backstop. gloo blocks the host in every wait anyway: its
  waits stay timed.

:func:`wait_work` turns any failure into a :class:`CollectiveError` naming the
collective, its ranks and the deadline; :meth:`CollectiveError.after_roll_call`
names the dead (or stalled) rank by a roll call over the rendezvous store
(:mod:`dmuon.comm.roll_call`), and the optimizer adds the step.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm.roll_call import (
    DEFAULT_GRACE,
    POLL_INTERVAL,
    RollCall,
    call_roll,
    note_collective,
)

__all__ = [
    "CollectiveError",
    "collective_timeout",
    "current_timeout",
    "pending_works",
    "settle",
    "stream_waits",
    "wait_work",
]

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


def wait_work(
    work: Any, what: str, group: Any = None, *, device: torch.device | None = None
) -> None:
    """Wait for a ``torch.distributed`` work object within the current deadline.

    On a backend whose wait is a stream wait (NCCL, :func:`stream_waits`) under a
    deadline, the host does not block: the current CUDA stream waits for the work, and
    the work is recorded for :func:`settle`, which checks the deadline before the next
    host read of a collective's result. Elsewhere (gloo) the wait blocks the host with
    the deadline, as always; without a deadline it is the backend's plain ``wait()``.

    Args:
        work: what ``dist.<collective>(..., async_op=True)`` returned (``None``: nothing).
        what: the collective, for the error message.
        group: its process group (``None``: the world), for the error message.
        device: the device of the collective's tensors, given by a caller whose next
            use of the result is on that device (kernels queued after the wait), not a
            read on the host: it lets a backend whose wait is a stream wait leave the
            host running (:func:`stream_waits`), and tells the backend of a group with one
            per device (``"cpu:gloo,cuda:nccl"``). ``None`` (a result read on the host
            next, or a caller that does not say): the host waits within the deadline,
            which is right on every backend.

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
        elif stream_waits(group, device):
            _stream_wait(work)  # returns at once: the stream, not the host, waits
            _record(_Pending(work, what, group, time.monotonic(), timeout.total_seconds()))
        else:
            work.wait(timeout=timeout)
        note_collective(None)  # left in place on failure: this rank was waiting in it
    except CollectiveError:
        raise
    except Exception as exc:  # gloo raises plain RuntimeError / DistBackendError
        raise failure(exc, what, group) from exc


# ----------------------------------------------------------------- stream-waited works
_STREAM_WAIT_BACKENDS = frozenset({"nccl"})
"""Backends whose ``wait()`` makes the current stream wait (and whose timed wait blocks
the host until the collective is done); their ``is_completed()`` never blocks."""

_BACKENDS: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()

MAX_PENDING = 1024
"""Recorded works at most: past it, the completed ones are dropped, and if that is not
enough the host waits (within its deadline) for the oldest — backpressure on a host
running that far ahead of the device."""

# settle's first and longest sleep between polls: short, as the read it stands before
# would have returned as soon as the device finished (a longer sleep is added latency
# every step); a hung collective is found within the deadline all the same
_POLL_S = (0.00005, 0.001)


@dataclass
class _Pending:
    work: Any
    what: str
    group: Any
    start: float  # time.monotonic() when wait_work recorded it
    timeout: float  # the deadline in force then, in seconds

    def overdue(self, now: float) -> bool:
        return now - self.start > self.timeout


_PENDING: deque[_Pending] = deque()
_LOCK = threading.Lock()  # backward hooks may wait on autograd's device threads


def _device_backends(group: Any) -> dict[str, str]:
    """``{device type: backend}`` of ``group`` (``None``: the world), cached per group."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return _BACKENDS[pg]
    except (KeyError, TypeError):
        pass
    config = str(dist.get_backend_config(group))  # "cuda:nccl", "cpu:gloo,cuda:nccl", ...
    found = dict(e.split(":", 1) for e in config.split(",") if ":" in e)
    if not found:  # a backend name without a device map
        found = {"*": config}
    with contextlib.suppress(TypeError):  # an object weakref cannot hold: not cached
        _BACKENDS[pg] = found
    return found


def stream_waits(group: Any = None, device: torch.device | None = None) -> bool:
    """Whether a wait on ``group``'s collectives is a stream wait (NCCL), not a host wait.

    Only for a caller that names ``device`` (the result's next use is a kernel on it, not
    a host read): without it, ``False``, and the host waits within the deadline, which
    is right on every backend. A group with one backend for every device then decides
    alone; a group with one per device (``"cpu:gloo,cuda:nccl"``, torch's default on a
    GPU machine) by ``device``'s type. ``False`` without a process group.

    Examples:
        >>> stream_waits(None)  # no process group here
        False
    """
    if device is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        backends = _device_backends(group)
    except Exception:  # a group this rank is not in, a fake: wait as always
        return False
    kinds = set(backends.values())
    if not kinds & _STREAM_WAIT_BACKENDS:
        return False
    if kinds <= _STREAM_WAIT_BACKENDS:
        return True
    return backends.get(torch.device(device).type) in _STREAM_WAIT_BACKENDS


def _stream_wait(work: Any) -> None:
    """The backend's untimed ``wait()``: on NCCL, the current stream waits for ``work``."""
    work.wait()


def _record(entry: _Pending) -> None:
    with _LOCK:
        # the oldest are the likeliest done: drop a few of them on the way (never blocks)
        for _ in range(4):
            if not _PENDING or not _done(_PENDING[0]):
                break
            _PENDING.popleft()
        _PENDING.append(entry)
        full = len(_PENDING) > MAX_PENDING
    if full:
        settle(bound=MAX_PENDING // 2)


def _done(entry: _Pending) -> bool:
    """Whether ``entry``'s work is complete (a work whose poll raises is not: settle
    raises for it)."""
    try:
        return bool(entry.work.is_completed())
    except Exception:
        return False


def pending_works() -> list[str]:
    """The collectives :func:`wait_work` left to the stream and :func:`settle` has not
    yet seen complete, oldest first (what they wait for).

    Examples:
        >>> pending_works()
        []
    """
    with _LOCK:
        return [p.what for p in _PENDING]


def settle(*, wait: bool = True, bound: int = 0) -> None:
    """Check the collectives :func:`wait_work` left to the stream, before a host read.

    Call it just before reading a collective's result on the host (``.tolist()``,
    ``.item()``): it polls every recorded work's ``is_completed()`` — on NCCL a query of
    its CUDA event, which never blocks — drops the completed ones, and sleeps briefly
    between polls until at most ``bound`` remain. A work past its deadline (counted from
    its :func:`wait_work`) raises; so does one whose poll raises. On gloo, or with no
    work recorded, it returns at once.

    The read of a CUDA tensor waits for the device anyway (the works recorded before
    were waited on the stream it reads), so waiting here first costs nothing and puts
    the deadline on it. The read of a host tensor does not: ``wait=False`` then only
    checks — one pass of polls, the overdue raising — and leaves the device running.

    Args:
        wait: poll until at most ``bound`` remain (``False``: one pass, no sleep).
        bound: how many incomplete works may remain (``0``: all must complete).

    Raises:
        CollectiveError: reason ``"timeout"`` naming the first overdue collective and its
            group's ranks, or the collective's own error; the record is emptied (the run
            cannot go on past a failed collective).

    Examples:
        >>> settle()
    """
    sleep, noted = _POLL_S[0], False
    while True:
        with _LOCK:
            if len(_PENDING) <= bound:
                break
            entries = list(_PENDING)
        now = time.monotonic()
        left: list[_Pending] = []
        for entry in entries:
            try:
                completed = bool(entry.work.is_completed())
                if completed:
                    _raise_if_failed(entry.work)
            except Exception as exc:
                _clear()
                raise failure(exc, entry.what, entry.group, entry.timeout) from exc
            if completed:
                continue
            if entry.overdue(now):
                _clear()
                note_collective(entry.what)  # the roll call reports this rank in it
                raise CollectiveError(
                    entry.what,
                    _ranks(entry.group),
                    entry.timeout,
                    "timeout",
                    f"{entry.what} not completed {now - entry.start:.1f} s after it was "
                    f"waited for (deadline {entry.timeout:g} s, checked before a host read)",
                )
            left.append(entry)
        with _LOCK:
            done = {id(e) for e in entries} - {id(e) for e in left}
            kept = [e for e in _PENDING if id(e) not in done]  # and those recorded meanwhile
            _PENDING.clear()
            _PENDING.extend(kept)
            if len(_PENDING) <= bound or not wait:
                break
        if left:  # what a roll call reports of this rank while it polls
            note_collective(left[0].what)
            noted = True
        time.sleep(sleep)
        sleep = min(2 * sleep, _POLL_S[1])
    if noted:
        note_collective(None)


def _raise_if_failed(work: Any) -> None:
    """Raise the error of a completed ``work``: its wait returns at once, or raises what
    the collective raised (``exception()``/``is_success()`` are deprecated in torch)."""
    work.wait()


def _clear() -> None:
    with _LOCK:
        _PENDING.clear()


def failure(
    exc: BaseException, what: str, group: Any = None, timeout: float | None = None
) -> CollectiveError:
    """The :class:`CollectiveError` for ``exc`` raised by collective ``what``.

    Examples:
        >>> failure(RuntimeError("Operation timed out!"), "broadcast").reason
        'timeout'
    """
    if isinstance(exc, CollectiveError):
        return exc
    limit = current_timeout() if timeout is None else timeout
    return CollectiveError(what, _ranks(group), limit, classify(exc), str(exc))
