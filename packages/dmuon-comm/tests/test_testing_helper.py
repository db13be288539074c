"""dmuon.comm.testing.run_on_ranks: the helper every multi-process test relies on."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from dmuon.comm.testing import RankFailure, run_on_ranks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _record_pid(tmp_path, rank):
    (tmp_path / f"rank{rank}.pid").write_text(str(os.getpid()))


def _assert_no_rank_process_left(tmp_path, world_size):
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(world_size)]
    assert pids and not any(_alive(p) for p in pids), "every rank process is gone"


def test_returns_each_ranks_value_in_rank_order_with_args_and_env():
    def body(rank, world_size, offset, *, scale):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x)
        env = (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"])
        return rank * scale + offset, x.item(), dist.get_world_size(), env

    got = run_on_ranks(body, 3, args=(10,), kwargs={"scale": 2}, timeout=30)
    total = float(0 + 1 + 2)
    assert got == [
        (10, total, 3, ("0", "3", "0")),
        (12, total, 3, ("1", "3", "1")),
        (14, total, 3, ("2", "3", "2")),
    ]


def test_single_rank_and_threads_per_rank():
    assert run_on_ranks(lambda r, n: (r, n, torch.get_num_threads()), 1) == [(0, 1, 1)]

    # A forked rank may use intra-op threads (the parent's pool is not inherited).
    def matmul(rank, n):
        x = torch.ones(256, 256)
        return torch.get_num_threads(), (x @ x)[0, 0].item()

    assert run_on_ranks(matmul, 2, threads_per_rank=2) == [(2, 256.0), (2, 256.0)]


def test_a_rank_that_raises_is_reported_with_its_traceback(tmp_path):
    def body(rank, world_size):
        _record_pid(tmp_path, rank)
        if rank == 1:
            raise ValueError("rank one cannot go on")
        dist.barrier()  # the others wait for rank 1, then fail on the closed connection

    with pytest.raises(RankFailure) as info:
        run_on_ranks(body, 3, timeout=30)
    err = info.value
    assert err.first_failure == 1
    assert err.outcomes[1].status == "raised"
    assert err.outcomes[1].error == "ValueError: rank one cannot go on"
    message = str(err)
    assert "rank 1 raised ValueError: rank one cannot go on" in message
    assert "--- traceback of rank 1 ---" in message
    assert 'raise ValueError("rank one cannot go on")' in message  # the failing source line
    assert message.index("rank 1 raised") < message.index("rank 0")  # root cause first
    _assert_no_rank_process_left(tmp_path, 3)


def test_a_rank_that_dies_is_reported_with_its_exit_code(tmp_path):
    def body(rank, world_size):
        _record_pid(tmp_path, rank)
        if rank == 2:
            os._exit(3)
        dist.barrier()

    with pytest.raises(RankFailure) as info:
        run_on_ranks(body, 3, timeout=30)
    err = info.value
    assert err.first_failure == 2
    died = err.outcomes[2]
    assert (died.rank, died.status, died.exitcode) == (2, "died", 3)
    assert "rank 2 died with exit code 3 before returning" in str(err)
    _assert_no_rank_process_left(tmp_path, 3)


@pytest.mark.timeout(60)  # the helper itself must not hang: this guards it
def test_a_rank_that_hangs_in_a_collective_is_killed_at_the_timeout(tmp_path):
    def body(rank, world_size):
        _record_pid(tmp_path, rank)
        if rank == 0:
            time.sleep(3600)  # never joins the all-reduce below
        dist.all_reduce(torch.ones(1))
        return rank

    with pytest.raises(RankFailure) as info:
        run_on_ranks(body, 3, timeout=4)
    err = info.value
    assert err.timed_out and err.first_failure == 0
    assert err.outcomes[0].status == "killed"
    assert "rank 0 did not finish: still running at the 4 s timeout (hung?); killed" in str(err)
    # Where it hung: the Python stack of the killed rank, taken before the kill.
    assert "in body" in err.outcomes[0].traceback
    assert "--- Python stacks of rank 0 when it was killed ---" in str(err)
    # Ranks 1 and 2 wait in the all-reduce: the process group's own timeout (set below
    # the helper's) makes them fail with a traceback pointing at the collective, or
    # they are killed too.
    for rank in (1, 2):
        outcome = err.outcomes[rank]
        assert outcome.status in ("raised", "killed")
        if outcome.status == "raised":
            assert "all_reduce" in outcome.traceback
    _assert_no_rank_process_left(tmp_path, 3)


def test_an_unpicklable_return_value_is_a_failure_of_that_rank():
    def body(rank, world_size):
        return (lambda: None) if rank == 1 else rank

    with pytest.raises(RankFailure, match="rank 1 raised TypeError: the value returned by rank 1"):
        run_on_ranks(body, 2, timeout=30)


def test_bad_arguments_raise_before_starting_anything():
    with pytest.raises(ValueError, match="world_size must be an int ≥ 1, got 0"):
        run_on_ranks(lambda r, n: None, 0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        run_on_ranks(lambda r, n: None, 1, timeout=0)
    with pytest.raises(ValueError, match="threads_per_rank"):
        run_on_ranks(lambda r, n: None, 1, threads_per_rank=0)
    with pytest.raises(ValueError, match=r"nccl.*spawn"):
        run_on_ranks(lambda r, n: None, 1, backend="nccl")


def _spawned_body(rank, world_size):
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    return x.item()


def test_spawn_start_method_with_a_module_level_function():
    assert run_on_ranks(_spawned_body, 2, start_method="spawn", timeout=120) == [3.0, 3.0]
