"""Naming the rank that died: a roll call over the rendezvous store after a collective fails.

When a peer process dies, gloo fails the collective with "Connection closed by
peer [10.0.0.7]:41234" — a socket address, not a rank — and the ranks that were
not connected to the dead one only run into their deadline. Neither says *which*
rank is gone. The rendezvous store (the key-value store every rank joined the
process group through) outlives a worker: under ``torchrun`` the elastic agent
hosts it. So DMuon asks it:

* every process that runs DMuon collectives starts one **responder**: a daemon
  thread that looks for the next call key every 0.2 s (one tiny ``store.check``;
  it never blocks inside the store client, so neither a normal exit nor the loss
  of the store can catch it in native code — a thread blocked in ``store.wait``
  aborts the process when the store server goes away at the end of a run);
* a rank whose collective failed **calls the roll**: it sets the call key, every
  live responder answers at once with its rank, host, process id and what its main
  thread is doing (:func:`note_phase`, :func:`note_collective`), and the ranks that
  do not answer within a short grace are named: their process is gone (killed,
  crashed, exited) or frozen in native code that holds the GIL;
* a rank that answers but is *not* waiting in a DMuon collective is the one the
  others were waiting for (hung in user code, or in another collective).

The store is, in this order, the one given to :func:`start_responder`, or a
client of ``MASTER_ADDR``:``MASTER_PORT`` (``env://`` rendezvous and ``torchrun``
set both). Without one, errors say so and still name the collective and the step.
Everything here is best effort: a roll call never raises, and never takes longer
than its grace plus the store's own timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = [
    "DEFAULT_GRACE",
    "POLL_INTERVAL",
    "RollCall",
    "call_roll",
    "note_collective",
    "note_phase",
    "noted_phase",
    "responder_status",
    "start_responder",
    "stop_responder",
]

POLL_INTERVAL = 0.2
"""Seconds between a responder's looks for a roll call."""

DEFAULT_GRACE = 1.0
"""Seconds a roll call waits for answers: a live responder answers within
:data:`POLL_INTERVAL` plus a store round trip."""

_PREFIX = "dmuon/roll_call/"
_STORE_TIMEOUT = datetime.timedelta(seconds=10)
_REUSE_S = 60.0  # a roll call concluded this recently is the answer to a new failure too


# ----------------------------------------------------------------- main-thread progress
# Plain attribute writes (atomic under the GIL): cheap enough for every collective.
_phase: tuple[str, float] = ("not in a DMuon step yet", time.monotonic())
_collective: tuple[str | None, float] = (None, time.monotonic())


def note_phase(text: str) -> None:
    """Record what this rank's main thread is doing (e.g. ``"DMuon step 7"``).

    A responder reports it when the roll is called.

    Examples:
        >>> note_phase("DMuon step 7")
    """
    global _phase
    _phase = (text, time.monotonic())


@contextlib.contextmanager
def noted_phase(text: str) -> Iterator[None]:
    """:func:`note_phase` ``text`` inside the block, the phase before it after.

    For a wait whose place tells the ranks apart (``"before layer 'blocks.3' runs"``):
    when ranks wait for different layers, the roll call lists them.

    Examples:
        >>> with noted_phase("before layer 'fc' runs"):
        ...     _progress()["phase"]
        "before layer 'fc' runs"
    """
    global _phase
    before = _phase
    _phase = (text, time.monotonic())
    try:
        yield
    finally:
        _phase = before


def note_collective(what: str | None) -> None:
    """Record the collective this rank is waiting in (``None``: none).

    Examples:
        >>> note_collective("broadcast of owners' updates"); note_collective(None)
    """
    global _collective
    _collective = (what, time.monotonic())


def _progress() -> dict[str, Any]:
    now = time.monotonic()
    phase, since = _phase
    what, waiting_since = _collective
    return {
        "phase": phase,
        "phase_s": round(now - since, 3),
        "collective": what,
        "collective_s": None if what is None else round(now - waiting_since, 3),
    }


# ----------------------------------------------------------------- the responder
@dataclass
class _Responder:
    rank: int
    store: Any  # the responder's own connection: a blocked wait holds its client
    caller: Any  # the main thread's connection (roll calls)
    where: str
    thread: threading.Thread | None = None
    stopping: bool = False
    error: str | None = None
    answered: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_RESPONDER: _Responder | None = None


def _env_store() -> tuple[Any, str] | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    store = dist.TCPStore(
        host, int(port), is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False
    )
    return store, f"the rendezvous store at {host}:{port} (MASTER_ADDR:MASTER_PORT)"


def _connection(store: Any) -> Any:
    """A second connection to ``store`` (a blocked ``wait`` holds a TCPStore client)."""
    try:
        return store.clone()
    except Exception:  # stores that cannot be cloned (FileStore) take concurrent calls
        return store


def start_responder(store: Any = None, rank: int | None = None) -> bool:
    """Start this process's responder (once; later calls keep the first).

    Args:
        store: a ``torch.distributed.Store`` every rank can reach (``None``: a client of
            ``MASTER_ADDR:MASTER_PORT`` when both are set).
        rank: this process's global rank (``None``: ``dist.get_rank()``).

    Returns:
        Whether a responder runs (False: no store could be found or reached).

    Examples:
        >>> start_responder()  # doctest: +SKIP
        True
    """
    global _RESPONDER
    if _RESPONDER is not None and _RESPONDER.error is None:
        return True
    try:
        rank = dist.get_rank() if rank is None else rank
        if store is None:
            found = _env_store()
            if found is None:
                return False
            store, where = found
        else:
            where = f"the given {type(store).__name__}"
        base = dist.PrefixStore(_PREFIX, store)
        responder = _Responder(rank, dist.PrefixStore(_PREFIX, _connection(store)), base, where)
        first = int(base.add("calls", 0)) + 1
    except Exception:
        return False
    responder.thread = threading.Thread(
        target=_respond, args=(responder, first), name="dmuon-roll-call", daemon=True
    )
    _RESPONDER = responder
    responder.thread.start()
    return True


def stop_responder() -> None:
    """Forget this process's responder (its thread ends at exit or at its next call).

    Examples:
        >>> stop_responder()
    """
    global _RESPONDER
    if _RESPONDER is not None:
        _RESPONDER.stopping = True
    _RESPONDER = None


def responder_status() -> str:
    """One line on this process's responder, for messages and logs.

    Examples:
        >>> stop_responder(); responder_status()
        'no roll-call responder (no store: pass store= to DMuon, or set MASTER_ADDR/MASTER_PORT)'
    """
    r = _RESPONDER
    if r is None:
        return (
            "no roll-call responder (no store: pass store= to DMuon, or set "
            "MASTER_ADDR/MASTER_PORT)"
        )
    if r.error is not None:
        return f"the roll-call responder stopped: {r.error}"
    return f"roll-call responder of rank {r.rank} on {r.where}, {r.answered} call(s) answered"


def _respond(r: _Responder, call: int) -> None:
    host, pid = socket.gethostname(), os.getpid()
    while not r.stopping:
        try:
            if not r.store.check([f"call/{call}"]):
                time.sleep(POLL_INTERVAL)
                continue
            answer = {"rank": r.rank, "host": host, "pid": pid, **_progress()}
            r.store.set(f"answer/{call}/{r.rank}", json.dumps(answer))
        except Exception as exc:  # the store is gone (end of the run, or its host died)
            r.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return
        r.answered += 1
        call += 1


@atexit.register
def _stop_at_exit() -> None:
    # Out of the store client before the interpreter finalises (at most one poll).
    r = _RESPONDER
    if r is not None and r.thread is not None:
        r.stopping = True
        r.thread.join(timeout=2 * POLL_INTERVAL + 1.0)


# ----------------------------------------------------------------- calling the roll
@dataclass(frozen=True)
class RollCall:
    """What a roll call found.

    Attributes:
        expected: the global ranks asked (those of the failed collective).
        answers: rank → its answer (``host``, ``pid``, ``phase``, ``collective``, …).
        absent: ranks that did not answer: process gone, or frozen holding the GIL.
        stalled: when every rank answered, those not waiting in a DMuon collective.
        caller: the rank that called this roll (another rank's call may be reused).
        age: seconds since the roll was concluded (0 for a fresh one).
        unavailable: why no roll call could be made (then the lists are empty).

    Examples:
        >>> RollCall([0, 1, 2], {}, [2], [], caller=0).summary()[:59]
        'roll call over ranks [0, 1, 2]: rank 2 did not answer — its'
    """

    expected: list[int]
    answers: dict[int, dict[str, Any]]
    absent: list[int]
    stalled: list[int]
    caller: int = -1
    age: float = 0.0
    unavailable: str | None = None

    def summary(self) -> str:
        """One sentence for an error message."""
        if self.unavailable is not None:
            return f"no roll call: {self.unavailable}"
        parts: list[str] = []
        if len(self.absent) == 1:
            parts.append(
                f"rank {self.absent[0]} did not answer — its process is gone (killed, crashed "
                "or exited) or frozen"
            )
        elif self.absent:
            parts.append(
                f"ranks {self.absent} did not answer — their processes are gone (killed, "
                "crashed or exited) or frozen"
            )
        for rank in self.stalled:
            a = self.answers[rank]
            parts.append(
                f"rank {rank} ({a.get('host')}, pid {a.get('pid')}) is alive but not in a "
                f"DMuon collective: {a.get('phase')!r} for {a.get('phase_s')} s — the others "
                "were waiting for it"
            )
        if not parts:
            parts.append(self._all_waiting())
        by = "" if self.age == 0 else f" (called by rank {self.caller} {self.age:.1f} s earlier)"
        return f"roll call over ranks {self.expected}{by}: " + "; ".join(parts)

    def _all_waiting(self) -> str:
        """Every rank answered from inside a DMuon collective: whether it was the same one."""
        where: dict[tuple[str, str], list[int]] = {}
        for rank in sorted(self.answers):
            a = self.answers[rank]
            where.setdefault((str(a.get("phase")), str(a.get("collective"))), []).append(rank)
        if len(where) < 2:
            return "every rank answered and was waiting in a DMuon collective"
        listed = [
            f"{_ranks(ranks)} in {phase!r} ({collective})"
            for (phase, collective), ranks in list(where.items())[:4]
        ]
        return (
            "every rank answered, but they wait in different DMuon collectives: "
            + "; ".join(listed)
            + " — a rank ran a step, save or load the others did not (e.g. a checkpoint "
            "saved on one rank only), or a layer with DMuon's weights the others did not "
            "(a branch taken on some ranks only); run it on every rank"
        )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def call_roll(expected: list[int], grace: float = DEFAULT_GRACE) -> RollCall:
    """Ask every rank of ``expected`` to answer; name those that do not, and the stalled.

    Called by a rank whose collective failed. A roll called by another rank for the
    same failure (concluded in the last minute) is reused rather than repeated: the
    dead do not come back, and the late ranks need not wait another grace.

    Args:
        expected: global ranks to ask (the failed collective's group).
        grace: seconds to wait for the answers.

    Returns:
        A :class:`RollCall` (``unavailable`` set when no store is reachable). Never raises.

    Examples:
        >>> stop_responder(); call_roll([0, 1]).unavailable is not None
        True
    """
    r = _RESPONDER
    if r is None:
        return RollCall(expected, {}, [], [], unavailable=responder_status())
    try:
        return _call(r, sorted(expected), grace)
    except Exception as exc:
        return RollCall(
            expected,
            {},
            [],
            [],
            unavailable=f"{r.where} did not answer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); the process hosting it "
            "(rank 0 under plain env://, the agent under torchrun) may be the one that died",
        )


def _call(r: _Responder, expected: list[int], grace: float) -> RollCall:
    store = r.caller
    with r.lock:  # one roll call at a time in this process
        latest = int(store.add("calls", 0))
        if latest > 0 and store.check([f"result/{latest}"]):
            found = json.loads(store.get(f"result/{latest}"))
            age = time.time() - found["time"]
            if age < _REUSE_S and set(found["expected"]) == set(expected):
                return RollCall(
                    expected,
                    {int(k): v for k, v in found["answers"].items()},
                    found["absent"],
                    found["stalled"],
                    caller=found["caller"],
                    age=max(age, 1e-3),
                )
        call = int(store.add("calls", 1))
        store.set(f"call/{call}", json.dumps({"caller": r.rank, "time": time.time()}))
        deadline = time.monotonic() + grace
        missing = list(expected)
        while missing and time.monotonic() < deadline:
            missing = [k for k in missing if not store.check([f"answer/{call}/{k}"])]
            if missing:
                time.sleep(0.01)
        answers = {
            k: json.loads(store.get(f"answer/{call}/{k}")) for k in expected if k not in missing
        }
        # with a rank gone, the others' states say nothing more: only name the stalled
        # when everyone answered (a hang, not a death)
        stalled = [] if missing else [k for k, a in answers.items() if a["collective"] is None]
        result = RollCall(expected, answers, missing, stalled, caller=r.rank)
        with contextlib.suppress(Exception):
            store.set(
                f"result/{call}",
                json.dumps(
                    {
                        "expected": expected,
                        "answers": answers,
                        "absent": missing,
                        "stalled": stalled,
                        "caller": r.rank,
                        "time": time.time(),
                    }
                ),
            )
        return result
