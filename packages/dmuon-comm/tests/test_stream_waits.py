"""Stream-waited works: on NCCL, :func:`wait_work` must not block the host.

NCCL's ``wait(timeout=...)`` blocks the host until the collective is done; ``wait()``
only makes the CUDA stream wait. With a deadline, :func:`wait_work` therefore leaves a
stream-wait backend's work to the stream and records it, and :func:`settle` checks the
deadline before a host read. There is no NCCL here: fake works stand in for NCCL's
(``wait()`` returns at once, ``is_completed()`` polls), and the backend map is
monkeypatched. gloo's timed wait is covered by ``tests-integration/test_timeouts.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from dmuon.comm import CollectiveError, collective_timeout, faults
from dmuon.comm.faults import pending_works, settle, stream_waits, wait_work


class FakeWork:
    """A work whose ``wait()`` returns at once (a stream wait) and whose timed wait would
    block the host (recorded, never done here); done when :attr:`done` is set."""

    def __init__(self, done: bool = False, error: str | None = None) -> None:
        self.done, self.error = done, error
        self.waits: list[Any] = []
        self.polls = 0

    def wait(self, timeout: Any = None) -> bool:
        self.waits.append(timeout)
        if timeout is not None:
            raise AssertionError("a timed wait blocks the host on NCCL")
        if self.done and self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done


class PollError(FakeWork):
    def is_completed(self) -> bool:
        raise RuntimeError("NCCL communicator was aborted: Connection reset by peer")


@pytest.fixture(autouse=True)
def nccl(monkeypatch):
    """Every group waits on the stream (as NCCL's), with an empty record before and after."""
    monkeypatch.setattr(faults, "stream_waits", lambda group=None, device=None: True)
    faults._clear()
    yield
    faults._clear()


def test_wait_work_leaves_the_work_to_the_stream_and_records_it():
    work = FakeWork()
    with collective_timeout(5):
        t0 = time.monotonic()
        wait_work(work, "broadcast of layer 'fc'")
    assert time.monotonic() - t0 < 0.5
    assert work.waits == [None]  # the untimed wait: the stream's, not the host's
    assert pending_works() == ["broadcast of layer 'fc'"]


def test_without_a_deadline_the_plain_wait_and_no_record():
    work = FakeWork()
    wait_work(work, "broadcast")
    assert work.waits == [None] and pending_works() == []


def test_settle_raises_a_timeout_naming_the_overdue_collective():
    stuck = FakeWork()
    with collective_timeout(0.3):
        wait_work(FakeWork(done=True), "all-gather of digests")
        wait_work(stuck, "reduce to owners of layer 'blocks.1'")
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        settle()
    took = time.monotonic() - t0
    err = info.value
    assert err.reason == "timeout" and err.timeout == pytest.approx(0.3)
    assert err.what == "reduce to owners of layer 'blocks.1'"
    text = str(err)
    assert "reduce to owners of layer 'blocks.1'" in text and "no answer within 0.3 s" in text
    assert 0.2 < took < 2.0, took
    assert stuck.polls > 1  # polled, not waited on
    assert pending_works() == []  # emptied: the run cannot go on


def test_settle_returns_once_the_works_complete_and_drops_them():
    works = [FakeWork() for _ in range(3)]
    with collective_timeout(10):
        for i, w in enumerate(works):
            wait_work(w, f"collective {i}")
    threading.Timer(0.2, lambda: [setattr(w, "done", True) for w in works]).start()
    t0 = time.monotonic()
    settle()
    assert 0.1 < time.monotonic() - t0 < 5
    assert pending_works() == []


def test_settle_without_waiting_checks_once_and_keeps_the_incomplete():
    done, running = FakeWork(done=True), FakeWork()
    with collective_timeout(10):
        wait_work(running, "running")
        wait_work(done, "done")
    t0 = time.monotonic()
    settle(wait=False)
    assert time.monotonic() - t0 < 0.1
    assert pending_works() == ["running"]  # the completed one dropped, the other kept


def test_settle_without_waiting_still_raises_for_an_overdue_work():
    with collective_timeout(0.05):
        wait_work(FakeWork(), "late")
    time.sleep(0.1)
    with pytest.raises(CollectiveError, match="late over ranks"):
        settle(wait=False)


def test_completed_works_are_dropped_as_new_ones_are_recorded():
    with collective_timeout(10):
        for i in range(50):
            wait_work(FakeWork(done=True), f"c{i}")
    assert len(pending_works()) <= 2


def test_the_record_is_bounded(monkeypatch):
    monkeypatch.setattr(faults, "MAX_PENDING", 8)
    works: list[FakeWork] = []

    def finish_later(w: FakeWork) -> None:
        threading.Timer(0.05, lambda: setattr(w, "done", True)).start()

    with collective_timeout(10):
        for i in range(30):
            w = FakeWork()
            works.append(w)
            finish_later(w)
            wait_work(w, f"c{i}")
            assert len(pending_works()) <= 9
    settle()


def test_a_work_whose_poll_raises_is_a_collective_error():
    with collective_timeout(10):
        wait_work(PollError(), "broadcast from owners", None)
    with pytest.raises(CollectiveError) as info:
        settle()
    assert info.value.reason == "peer_died" and info.value.timeout == 10
    assert pending_works() == []


def test_a_completed_work_that_failed_is_a_collective_error():
    work = FakeWork()
    with collective_timeout(10):
        wait_work(work, "all-reduce of flags")
    work.done, work.error = True, "Connection closed by peer [10.0.0.7]:4242"
    with pytest.raises(CollectiveError, match="all-reduce of flags") as info:
        settle()
    assert info.value.reason == "peer_died"


# ----------------------------------------------------------------- the backend predicate
class Group:
    """A stand-in for a process group (weakly referable, as torch's are)."""


@pytest.mark.parametrize(
    ("config", "device", "expected"),
    [
        # only for a caller that names the device its result is used on next
        ("cuda:nccl", None, False),
        ("cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:gloo", None, False),
        ("cpu:gloo,cuda:gloo", "cuda", False),
        # torch's default on a GPU machine: by the tensors' device, else the timed wait
        ("cpu:gloo,cuda:nccl", None, False),
        ("cpu:gloo,cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:nccl", "cpu", False),
    ],
)
def test_stream_waits_by_backend_and_device(monkeypatch, config, device, expected):
    monkeypatch.undo()  # the real predicate
    calls: list[Any] = []

    def backend_config(group=None):
        calls.append(group)
        return config

    monkeypatch.setattr(faults.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(faults.dist, "get_backend_config", backend_config)
    group = Group()
    dev = None if device is None else torch.device(device)
    assert stream_waits(group, dev) is expected
    assert stream_waits(group, dev) is expected
    assert calls == ([] if dev is None else [group])  # cached per group; not asked without


def test_without_a_process_group_nothing_waits_on_a_stream(monkeypatch):
    monkeypatch.undo()
    assert stream_waits(None) is False
    work = FakeWork()
    work.wait = lambda timeout=None: work.waits.append(timeout)  # type: ignore[method-assign]
    with collective_timeout(5):
        wait_work(work, "broadcast")
    assert [t is not None for t in work.waits] == [True]  # the timed wait, as always
    assert pending_works() == []
