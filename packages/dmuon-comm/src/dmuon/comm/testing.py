"""Run a function on N real processes joined in a process group, for tests.

Like :mod:`torch.testing`, this module is public so that every package of the
project (and its users) can test distributed code the same way: real processes,
a real ``gloo`` process group on localhost, no mock of :mod:`torch.distributed`,
and a hard timeout so that a bug fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "RankOutcome", "rank_store", "run_on_ranks"]

# After the first rank fails, the others get this long to finish or fail on their
# own (so that every rank's error is reported) before they are killed.
_GRACE_AFTER_FAILURE_S = 3.0

_STORE: dist.Store | None = None  # the rendezvous store, inside a rank of run_on_ranks


def rank_store() -> dist.Store:
    """The store this rank of :func:`run_on_ranks` joined its process group through.

    Pass it where a rendezvous store is wanted, e.g. ``DMuon(..., store=rank_store())``
    so that a failed collective names the dead rank (:mod:`dmuon.comm.roll_call`).

    Raises:
        RuntimeError: called outside a rank of :func:`run_on_ranks`.

    Examples:
        >>> def body(rank, world_size):
        ...     return rank_store().add("ranks", 1) >= 1
        >>> run_on_ranks(body, 2, timeout=30)
        [True, True]
    """
    if _STORE is None:
        raise RuntimeError("rank_store() is only available inside a rank of run_on_ranks")
    return _STORE


@dataclass(frozen=True)
class RankOutcome:
    """What happened on one rank of a :func:`run_on_ranks` call.

    Attributes:
        rank: the rank.
        status: ``"ok"`` (returned), ``"raised"`` (an exception escaped ``fn``),
            ``"died"`` (the process exited without reporting, e.g. ``os._exit`` or a
            signal) or ``"killed"`` (still running at the timeout, or after another
            rank failed, and killed).
        value: the return value (``"ok"`` only).
        error: ``"ExceptionType: message"`` (``"raised"`` only).
        traceback: the rank's formatted traceback (``"raised"``), or the Python stacks
            of all its threads when it was killed (``"killed"``, from
            :mod:`faulthandler`).
        exitcode: the process exit code (negative: the signal that ended it).
        when: ``time.time()`` when the rank raised, or when its death was noticed.

    Examples:
        >>> RankOutcome(rank=1, status="died", exitcode=3).summary()
        'rank 1 died with exit code 3 before returning'
    """

    rank: int
    status: str
    value: Any = None
    error: str = ""
    traceback: str = ""
    exitcode: int | None = None
    when: float = 0.0

    def summary(self) -> str:
        """One line saying what happened, for error messages."""
        if self.status == "ok":
            return f"rank {self.rank} returned"
        if self.status == "raised":
            return f"rank {self.rank} raised {self.error}"
        if self.status == "died":
            code = self.exitcode
            how = (
                f"was killed by signal {-code}"
                if code is not None and code < 0
                else f"died with exit code {code}"
            )
            return f"rank {self.rank} {how} before returning"
        return f"rank {self.rank} did not finish and was killed"


class RankFailure(RuntimeError):
    """Raised by :func:`run_on_ranks` when a rank raised, died or did not finish.

    Attributes:
        outcomes: one :class:`RankOutcome` per rank, in rank order.
        timed_out: True when the overall timeout expired.
        first_failure: the likely root cause: the first rank that did not finish
            when the run timed out, else the rank whose failure was reported first
            (the others then usually fail on closed connections).

    The message names every rank that failed, the first failure first, with the
    full traceback of each rank that raised.

    Examples:
        >>> err = RankFailure("boom", [RankOutcome(0, "ok"), RankOutcome(1, "killed")])
        >>> err.failed_ranks
        [1]
    """

    def __init__(
        self,
        message: str,
        outcomes: Sequence[RankOutcome],
        timed_out: bool = False,
        first_failure: int | None = None,
    ):
        super().__init__(message)
        self.outcomes = list(outcomes)
        self.timed_out = timed_out
        self.first_failure = first_failure

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks whose status is not ``"ok"``."""
        return [o.rank for o in self.outcomes if o.status != "ok"]


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    Each rank is a fresh process (``fork`` by default: fast, and ``fn`` may be a
    closure) that joins a default process group of ``world_size`` ranks on
    localhost before calling ``fn``. The rendezvous goes through a
    :class:`torch.distributed.FileStore` in a fresh temporary directory (no port to
    pick, no server thread in this process, no name lookups), gloo uses the
    loopback interface unless ``GLOO_SOCKET_IFNAME`` is set, and every rank has
    joined before any rank starts ``fn``; a rank that has returned waits for the
    others before its process exits. The environment variables ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set in each rank,
    and ``torch.set_num_threads(threads_per_rank)``.

    The call returns the ranks' return values in rank order (they must be
    picklable). It raises :class:`RankFailure`, within ``timeout`` seconds, if

    * a rank raises — the message carries that rank's number and full traceback
      (after the first failure the other ranks get a few seconds to finish or fail
      too, so a bad input that fails on every rank reports every rank);
    * a rank dies without returning (``os._exit``, a signal, a crash) — the message
      gives its rank and exit code;
    * ranks are still running at the timeout (a hang, e.g. a collective that another
      rank never joins) — the message lists the ranks that did not finish, with the
      Python stack of every thread of each at the moment it was stopped.

    Ranks are forked from the caller, so modules the caller has imported are
    already loaded in them; a module a rank imports lazily is imported once per
    rank, all at the same time. Import heavy modules before the call (the first
    ``torch.testing.assert_close``, for instance, imports
    ``torch.distributed.tensor``, about a second on a small CPU).

    Every rank process is killed before the call returns or raises; a rank whose
    parent dies is killed by the kernel too (Linux ``PR_SET_PDEATHSIG``), so no
    process is left behind. The process group's own timeout is set a little below
    ``timeout``, so that a rank stuck in a collective usually fails with a
    traceback pointing at that collective.

    Args:
        fn: called as ``fn(rank, world_size, *args, **kwargs)`` in each rank. With
            ``start_method="spawn"`` it (and its arguments) must be picklable.
        world_size: number of ranks (≥ 1).
        args: extra positional arguments for ``fn``.
        kwargs: extra keyword arguments for ``fn``.
        timeout: seconds for the whole run, start-up included.
        backend: ``"gloo"`` (CPU, the default) or ``"nccl"`` (one GPU per rank, needs
            ``start_method="spawn"``).
        threads_per_rank: ``torch.set_num_threads`` in each rank.
        start_method: ``"fork"`` (default, fast) or ``"spawn"``.

    Raises:
        ValueError: a bad ``world_size``, ``timeout``, ``threads_per_rank``,
            ``backend``/``start_method`` combination.
        RankFailure: a rank raised, died or did not finish in time.

    Examples:
        >>> import torch, torch.distributed as dist
        >>> def body(rank, world_size):
        ...     x = torch.tensor([float(rank)])
        ...     dist.all_reduce(x)
        ...     return x.item()
        >>> run_on_ranks(body, 3, timeout=30)
        [3.0, 3.0, 3.0]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int ≥ 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be an int ≥ 1, got {threads_per_rank!r}")
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be 'fork', 'spawn' or 'forkserver', got {start_method!r}"
        )
    if backend == "nccl" and start_method == "fork":
        raise ValueError(
            "backend='nccl' needs start_method='spawn' (CUDA cannot be used after fork)"
        )

    ctx: Any = multiprocessing.get_context(start_method)
    deadline = time.monotonic() + timeout
    pg_timeout = max(1.0, timeout - min(5.0, 0.25 * timeout))
    # Rendezvous through a file, not a TCPStore: a TCP store server is a thread in
    # this process (a rank forked while it holds a lock inherits the lock held and
    # hangs) and it reverse-resolves every peer address (5 s stalls where DNS does
    # not answer). The directory also receives the stacks of hung ranks.
    workdir = tempfile.mkdtemp(prefix="dmuon-ranks-")
    procs: list[Any] = []
    conns: list[multiprocessing.connection.Connection] = []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    rank,
                    world_size,
                    tuple(args),
                    dict(kwargs or {}),
                    workdir,
                    backend,
                    threads_per_rank,
                    pg_timeout,
                    send_end,
                ),
                name=f"dmuon-rank-{rank}",
                daemon=True,
            )
            p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        outcomes, timed_out, order = _collect(procs, conns, deadline, workdir)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        for c in conns:
            c.close()
        shutil.rmtree(workdir, ignore_errors=True)

    if all(o.status == "ok" for o in outcomes):
        return [o.value for o in outcomes]
    first = order[0] if order else None
    message = _failure_message(fn, world_size, timeout, outcomes, timed_out, order)
    raise RankFailure(message, outcomes, timed_out, first)


def _collect(
    procs: list[Any],
    conns: list[multiprocessing.connection.Connection],
    deadline: float,
    stacks: str,
) -> tuple[list[RankOutcome], bool, list[int]]:
    """Every rank's outcome, whether the deadline passed, and failed ranks, likely cause first."""
    n = len(procs)
    results: dict[int, RankOutcome] = {}
    open_conns = {c: r for r, c in enumerate(conns)}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    failure_deadline: float | None = None
    timed_out = False
    order: list[int] = []
    while len(results) < n:
        now = time.monotonic()
        limit = deadline if failure_deadline is None else min(deadline, failure_deadline)
        if now >= limit:
            timed_out = failure_deadline is None or deadline <= failure_deadline
            break
        ready = multiprocessing.connection.wait(
            [*open_conns, *(s for s, r in sentinels.items() if r not in results)],
            timeout=limit - now,
        )
        for obj in ready:
            if obj in open_conns:
                rank = open_conns.pop(obj)
                # EOF: died before reporting; its sentinel tells us how.
                with contextlib.suppress(EOFError, OSError):
                    results[rank] = pickle.loads(obj.recv_bytes())
            else:
                rank = sentinels[obj]
                if rank in results:
                    continue
                conn = conns[rank]
                if conn in open_conns and conn.poll():
                    # The report and the exit raced: read the report first.
                    with contextlib.suppress(EOFError, OSError):
                        results[rank] = pickle.loads(conn.recv_bytes())
                        open_conns.pop(conn)
                        continue
                procs[rank].join(timeout=1)
                results[rank] = RankOutcome(
                    rank, "died", exitcode=procs[rank].exitcode, when=time.time()
                )
        order = _by_cause(results)
        if failure_deadline is None and order:
            failure_deadline = time.monotonic() + _GRACE_AFTER_FAILURE_S
    running = [r for r in range(n) if r not in results]
    for r in running:  # ask each rank still running where it is (faulthandler, SIGUSR1)
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    if running:
        time.sleep(0.5)
    outcomes = [
        results.get(r, RankOutcome(r, "killed", traceback=_read_stack(stacks, r), exitcode=None))
        for r in range(n)
    ]
    hung = [o.rank for o in outcomes if o.status == "killed"]
    timed_out = timed_out and bool(hung)
    # After a timeout the ranks that never finished come first: the others usually
    # failed because of them (their collectives timed out waiting).
    order = [*hung, *(r for r in order if r not in hung)] if timed_out else [*order, *hung]
    return outcomes, timed_out, order


def _by_cause(results: dict[int, RankOutcome]) -> list[int]:
    """Failed ranks, likely root causes first.

    A rank that died comes first (its peers then fail on closed connections, often
    noticed in the same instant); ranks that raised follow in the order they raised
    (one clock: every rank runs on this machine).
    """
    failed = [o for o in results.values() if o.status != "ok"]
    failed.sort(key=lambda o: (o.status != "died", o.when, o.rank))
    return [o.rank for o in failed]


def _read_stack(stacks: str, rank: int) -> str:
    try:
        with open(os.path.join(stacks, f"rank{rank}.txt")) as f:
            return f.read()
    except OSError:
        return ""


def _failure_message(
    fn: Callable[..., Any],
    world_size: int,
    timeout: float,
    outcomes: list[RankOutcome],
    timed_out: bool,
    order: list[int],
) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    first = "ranks that did not finish first" if timed_out else "likely root cause first"
    lines = [f"run_on_ranks({name}, world_size={world_size}) failed ({first}):"]
    for o in (outcomes[r] for r in order):
        if o.status == "killed":
            why = (
                f"still running at the {timeout:g} s timeout (hung?)"
                if timed_out
                else "still running after another rank failed"
            )
            lines.append(f"  rank {o.rank} did not finish: {why}; killed")
        elif o.status != "ok":
            lines.append(f"  {o.summary()}")
    finished = [o.rank for o in outcomes if o.status == "ok"]
    if finished:
        lines.append(f"  ranks that returned normally: {finished}")
    for o in (outcomes[r] for r in order):
        if o.status == "raised":
            lines.append(f"\n--- traceback of rank {o.rank} ---\n{o.traceback.rstrip()}")
        elif o.status == "killed" and o.traceback:
            lines.append(
                f"\n--- Python stacks of rank {o.rank} when it was killed ---\n"
                f"{o.traceback.rstrip()}"
            )
    return "\n".join(lines)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    workdir: str,
    backend: str,
    threads_per_rank: int,
    pg_timeout: float,
    conn: multiprocessing.connection.Connection,
) -> None:
    global _STORE
    _die_with_parent()
    stack_file = open(os.path.join(workdir, f"rank{rank}.txt"), "w")  # noqa: SIM115 (kept open)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Loopback explicitly: the default device resolves the host name first.
        loopback = "lo" if os.path.exists("/sys/class/net/lo") else None
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
    torch.set_num_threads(threads_per_rank)
    report: RankOutcome
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = _STORE = dist.FileStore(os.path.join(workdir, "store"), world_size)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        # Every rank is connected before any runs fn: a rank that finished at once
        # would otherwise close its sockets while others are still connecting.
        dist.barrier()
        value = fn(rank, world_size, *args, **kwargs)
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"the value returned by rank {rank} cannot be pickled back to the caller: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        report = RankOutcome(rank, "ok", value=value)
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        report = RankOutcome(
            rank,
            "raised",
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(),
            when=time.time(),
        )
    with contextlib.suppress(Exception):
        # Plain pickle, not the connection's ForkingPickler: once torch.multiprocessing
        # is imported (FSDP2 and DTensor import it) that one sends tensors as handles to
        # shared memory, which die with this process right after.
        conn.send_bytes(pickle.dumps(report))
        conn.close()
    if report.status == "ok" and dist.is_initialized():
        # Keep this rank's connections open until every rank is done: exiting while a
        # peer still completes a handshake with it (new_group) or reads from it fails
        # that peer. The report is already sent, so if another rank failed the parent
        # simply kills this process once every rank has reported.
        with contextlib.suppress(Exception):
            dist.barrier()
            dist.destroy_process_group()
    # Skip the parent's atexit handlers and buffered state inherited through fork.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
