"""The deadline of DMuon's own collectives: ``DMuon(timeout=...)``.

A collective that one rank never enters (it skipped ``opt.step()``, it stalled,
it died) otherwise waits for the process group's timeout — 30 minutes under gloo,
10 under NCCL — and then fails without saying which rank is missing. Under a
deadline every rank raises :class:`dmuon.comm.CollectiveError` at the deadline
and the roll call (:mod:`dmuon.comm.roll_call`) names the rank that stalled and
where it was.

``timeout="auto"`` (the default) chooses a deadline no healthy run reaches:

    deadline = max(floor, factor · slowest iteration so far)

with ``floor`` = :data:`AUTO_FLOOR_SECONDS` (300 s: the first steps compile,
autotune and warm caches, and a rank may save a checkpoint while the others wait)
and ``factor`` = :data:`AUTO_ITERATION_FACTOR` (20) times the longest interval
between two ``opt.step()`` calls measured so far (a whole training iteration:
forward, backward, the step and whatever the loop does besides). A loop whose
ranks legitimately wait on one rank for longer than five minutes before the first
such iteration was measured (e.g. rank 0 alone writing a large checkpoint) sets
``timeout=`` in seconds, or ``None`` for the process group's own timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AUTO_FLOOR_SECONDS", "AUTO_ITERATION_FACTOR", "Deadline", "check_timeout"]

AUTO_FLOOR_SECONDS = 300.0
"""The least deadline ``timeout="auto"`` gives (seconds)."""

AUTO_ITERATION_FACTOR = 20.0
"""``timeout="auto"``: the deadline is at least this many times the slowest iteration."""


MAX_TIMEOUT_SECONDS = datetime.timedelta.max.total_seconds()
"""The longest ``timeout=`` (seconds) a deadline can hold: ``datetime.timedelta``'s."""


def check_timeout(timeout: Any) -> float | str | None:
    """``timeout=`` of ``DMuon``, checked: seconds (> 0) as ``float``, ``"auto"`` or ``None``.

    Examples:
        >>> check_timeout(5), check_timeout("auto"), check_timeout(None)
        (5.0, 'auto', None)
    """
    if timeout is None or timeout == "auto":
        return timeout
    # finite, and at most timedelta's largest (~2.7 million years): math.inf or 1e20
    # overflowed the timedelta it becomes (OverflowError); None is the way to wait as
    # long as the process group does
    seconds = math.nan
    if not isinstance(timeout, bool) and isinstance(timeout, (int, float)):
        with contextlib.suppress(OverflowError):  # an int past float's range (10**400)
            seconds = float(timeout)
    if not 0 < seconds <= MAX_TIMEOUT_SECONDS:  # NaN and inf fail too
        raise ValueError(
            "timeout must be a positive number of seconds, 'auto' (a deadline derived from "
            "the measured iteration time, at least 300 s) or None (the process group's "
            f"timeout); got {timeout!r}"
        )
    return seconds


@dataclass
class Deadline:
    """The deadline each step runs under, from ``timeout=`` and the measured iterations.

    Attributes:
        setting: ``timeout=`` as checked by :func:`check_timeout`.
        slowest: the longest interval between two consecutive steps seen (seconds).

    Examples:
        >>> d = Deadline("auto")
        >>> d.seconds()
        300.0
        >>> d.observe(now=100.0); d.observe(now=130.0)  # a 30 s iteration
        >>> d.seconds()
        600.0
        >>> Deadline(5.0).seconds(), Deadline(None).seconds()
        (5.0, None)
    """

    setting: float | str | None
    slowest: float = 0.0
    _last: float | None = field(default=None, repr=False)

    def seconds(self) -> float | None:
        """The deadline of the next step's collectives (``None``: the process group's)."""
        if self.setting == "auto":
            return max(AUTO_FLOOR_SECONDS, AUTO_ITERATION_FACTOR * self.slowest)
        return None if self.setting is None else float(self.setting)

    def observe(self, now: float | None = None) -> None:
        """Note that a step begins (at ``now``, default the monotonic clock)."""
        now = time.monotonic() if now is None else now
        if self._last is not None:
            self.slowest = max(self.slowest, now - self._last)
        self._last = now
