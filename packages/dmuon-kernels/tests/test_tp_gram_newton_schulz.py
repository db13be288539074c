"""tp_gram_newton_schulz: the shards of a split matrix give the shards of the whole result.

References: the exact map of the iteration, ``U φ(Σ) Vᵀ`` from a float64 SVD
(``nsref.expected_output``), and ``gram_newton_schulz`` on the whole matrix. The
tensor-parallel group is simulated by threads that meet at a barrier (every
"rank" sees the same reduced tensor, as after an all-reduce), and once by real
gloo processes with ``torch.distributed.all_reduce``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from nsref import expected_output, rel_err

from dmuon.kernels import REDUCE_OPS, gram_newton_schulz, tp_gram_newton_schulz


def identity(tensor, op):
    assert op in REDUCE_OPS
    return tensor


class ThreadGroup:
    """t threads standing in for the ranks of a group; ``reduce`` is an all-reduce."""

    def __init__(self, t: int):
        self.slots: list[torch.Tensor | None] = [None] * t
        self.barrier = threading.Barrier(t, timeout=60)  # a bug fails, never hangs

    def reduce_of(self, rank: int):
        def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)  # same order on every rank: same result
            out = stacked.sum(0) if op == "sum" else stacked.amax(0)
            self.barrier.wait()  # every rank has read before a slot is overwritten
            return out

        return reduce


def run_split(G: torch.Tensor, t: int, split_dim: int, **kw) -> torch.Tensor:
    """Split G over t simulated ranks, run every shard, put the results back together."""
    shards = G.tensor_split(t, dim=split_dim)
    group = ThreadGroup(t)
    out: list[torch.Tensor | BaseException | None] = [None] * t

    def rank(r: int) -> None:
        try:
            out[r] = tp_gram_newton_schulz(
                shards[r], split_dim=split_dim, reduce=group.reduce_of(r), **kw
            )
        except BaseException as exc:  # surface it in the test, and free the others
            group.barrier.abort()
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(t)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    for r, o in enumerate(out):
        if isinstance(o, BaseException):
            raise AssertionError(f"rank {r} failed") from o
        assert isinstance(o, torch.Tensor), f"rank {r} did not finish"
    return torch.cat(out, dim=split_dim)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (40, 40), (3, 16, 48)], ids=str)
def test_identity_reduce_on_the_whole_matrix_is_gram_newton_schulz(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for split_dim in (-1, -2):
        O = tp_gram_newton_schulz(
            G, split_dim=split_dim, reduce=identity, compute_dtype=torch.float64
        )
        # fp64 rounding only (a square matrix runs the standard iteration there)
        ref = gram_newton_schulz(G, compute_dtype=torch.float64)
        assert rel_err(O, ref) < 1e-12


@pytest.mark.parametrize("t", [2, 3, 4])
@pytest.mark.parametrize("split_dim", [-1, -2])
@pytest.mark.parametrize(
    "shape",
    # wide, tall, square, uneven splits (45 and 30 over 2–4), a batch; for the wide
    # 24×90 split by rows the short (Gram) side is the split one: the Gram is 90×90
    [(24, 90), (90, 24), (30, 30), (45, 64), (2, 20, 45)],
    ids=str,
)
def test_shards_equal_the_exact_map_of_the_whole_matrix(t, split_dim, shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    O = run_split(G, t, split_dim, compute_dtype=torch.float64)
    assert rel_err(O, expected_output(G, "polar_express")) < 1e-10


@pytest.mark.parametrize(
    ("compute_dtype", "split_dim", "tol"),
    [
        # Split by columns: the 48×48 Gram of the whole-matrix iteration. As in
        # test_orthogonalize.test_gram_equals_standard, fp32 rounding stays near 2e-6
        # and bf16's 8-bit mantissa compounds to ~3e-2 (the summed partial Gram
        # matrices round once more than the whole one).
        (torch.float32, -1, 2e-5),
        (torch.bfloat16, -1, 6e-2),
        # Split by rows: the iteration runs on the 160×160 Gram of rank 48, restarting
        # at every step (the default for a long Gram side); rounding gives R spurious
        # eigenvalues in its null space, which the polynomial amplifies (φ'(0) ≈ 8).
        (torch.float32, -2, 1e-4),
        (torch.bfloat16, -2, 6e-2),  # 0.2 with the one restart of the short side
    ],
)
def test_low_precision_shards_match_the_whole_matrix_iteration(compute_dtype, split_dim, tol):
    G = torch.randn(48, 160, generator=torch.Generator().manual_seed(5))
    O = run_split(G, 3, split_dim, compute_dtype=compute_dtype)
    one = run_split(G, 1, split_dim, compute_dtype=compute_dtype)
    assert O.dtype == G.dtype and O.shape == G.shape
    assert rel_err(O, expected_output(G.double(), "polar_express")) < tol
    assert rel_err(O, one) < tol  # splitting adds no error of its own


@given(
    m=st.integers(1, 24),
    n=st.integers(1, 24),
    t=st.integers(1, 5),  # t > m or n: some shards are empty
    split_dim=st.sampled_from([-1, -2]),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_split(m, n, t, split_dim, seed):
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    O = run_split(G, t, split_dim, compute_dtype=torch.float32)
    # fp32 rounding of five polynomial steps on singular values in (0, 1]
    assert rel_err(O, expected_output(G, "polar_express")) < 1e-4


def test_zero_matrix_gives_zero_not_nan():
    O = run_split(torch.zeros(8, 20), 2, -1, compute_dtype=torch.float32)
    assert torch.equal(O, torch.zeros(8, 20))


def test_scale_is_taken_over_the_whole_matrix():
    # one shard holds entries 1e30 larger than the other: a per-shard normalisation
    # would orthogonalise the small shard on its own
    G = torch.randn(16, 64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    G[:, :32] *= 1e30
    O = run_split(G, 2, -1, compute_dtype=torch.float64)
    assert rel_err(O, expected_output(G, "polar_express")) < 1e-10


def test_reduce_is_called_once_per_scalar_and_once_per_gram_matrix():
    calls: list[tuple[str, tuple[int, ...]]] = []

    def counting(tensor, op):
        calls.append((op, tuple(tensor.shape)))
        return tensor

    G = torch.randn(2, 8, 32)
    tp_gram_newton_schulz(G, split_dim=-1, reduce=counting, restarts=(1, 3))
    # max of each matrix; its squared norm and the split size; the Gram at start, restarts
    assert calls == [("max", (2,)), ("sum", (3,)), *[("sum", (2, 8, 8))] * 3]


@pytest.mark.parametrize(
    ("shape", "split_dim", "restarts"),
    [
        ((8, 32), -1, 1),  # the Gram side (8) is the short side: one restart
        ((32, 8), -2, 1),  # tall, split by rows: runs on the transpose, Gram side 8
        ((8, 32), -2, 4),  # the Gram side is the long one (32): restart every step
        ((32, 8), -1, 4),
    ],
)
def test_a_long_gram_side_restarts_at_every_step(shape, split_dim, restarts):
    grams = []

    def counting(tensor, op):
        grams.extend([tensor.shape] if tensor.ndim == 3 else [])
        return tensor

    tp_gram_newton_schulz(torch.randn(*shape), split_dim=split_dim, reduce=counting)
    assert len(grams) == 1 + restarts


def test_reduce_may_work_in_place_and_return_none():
    G = torch.randn(8, 32, dtype=torch.float64)
    O = tp_gram_newton_schulz(G, split_dim=-1, reduce=lambda t, op: None)
    ref = tp_gram_newton_schulz(G, split_dim=-1, reduce=identity)
    assert torch.equal(O, ref)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(split_dim=0), r"split_dim must be -1 \(columns\) or -2 \(rows\).*\(2, 4, 6\)"),
        (dict(split_dim=True), "split_dim"),
        (dict(split_dim=-1, reduce="sum"), "reduce must be a callable"),
        (dict(split_dim=-1, reduce=lambda t, op: t.sum()), r"reduce\(tensor, 'max'\)"),
        (dict(split_dim=-1, restarts=(7,)), "restarts"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    kwargs = {"reduce": identity, **kwargs}
    with pytest.raises(ValueError, match=match):
        tp_gram_newton_schulz(torch.randn(2, 4, 6), **kwargs)


# -- real processes --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, G: torch.Tensor, queue) -> None:
    try:
        # A forked child must not enter the parent's OpenMP pool (it can hang there).
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        shard = G.tensor_split(world, dim=-1)[rank]

        def reduce(tensor, op):
            dist.all_reduce(tensor, op=ops[op])
            return tensor

        O = tp_gram_newton_schulz(shard, split_dim=-1, reduce=reduce, compute_dtype=torch.float64)
        queue.put((rank, O.tolist()))  # plain data: a tensor would travel as shared memory
        dist.destroy_process_group()
    except BaseException as exc:
        queue.put((rank, repr(exc)))


def test_gloo_ranks_all_reducing_the_gram_matrix_equal_the_whole_matrix():
    world = 3
    G = torch.randn(20, 70, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, G, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not failed, failed
    O = torch.cat([torch.tensor(results[r], dtype=torch.float64) for r in range(world)], dim=-1)
    assert rel_err(O, expected_output(G, "polar_express")) < 1e-10


@pytest.mark.parametrize("steps", [1, 2])
def test_short_schedules_run_without_the_default_restart(steps):
    """1 or 2 steps: no restart to take (the default (2,) raised, and so did DMuon's
    ``ns_steps=2`` on tensor-parallel matrices)."""
    G = torch.randn(64, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    O = tp_gram_newton_schulz(
        G, split_dim=-1, reduce=identity, steps=steps, compute_dtype=torch.float64
    )
    ref = gram_newton_schulz(G, steps=steps, restarts=(), compute_dtype=torch.float64)
    assert rel_err(O, ref) < 1e-12


def test_bf16_takes_the_bf16_default_restart():
    """A short Gram side restarts once, where the whole-matrix kernel does: at 3 in bf16."""
    G = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    O = tp_gram_newton_schulz(G, split_dim=-1, reduce=identity, compute_dtype=torch.bfloat16)
    at_three = tp_gram_newton_schulz(
        G, split_dim=-1, reduce=identity, compute_dtype=torch.bfloat16, restarts=(3,)
    )
    assert torch.equal(O, at_three)
    assert not torch.equal(
        O,
        tp_gram_newton_schulz(
            G, split_dim=-1, reduce=identity, compute_dtype=torch.bfloat16, restarts=(2,)
        ),
    )
