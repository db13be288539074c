"""Ranks that repeat the same orthogonalisation keep bitwise-equal weights whatever each
rank's autotuner would choose.

On CUDA, ``backend="auto"`` times its candidates in each process, so two ranks can pick
different products for the same shape (the Triton kernels and cuBLAS differ by about
2e-3 relative after a Gram call on an H200: ``benchmarks/results/gpu-check-*.json``).
In ``single`` mode under DDP every rank repeats the whole step on the same averaged
gradients, and in ``sign`` mode every rank orthogonalises every matrix: replicas would
drift apart. The engines of those modes run the step without the autotuner
(``Engine.products``: :func:`dmuon.kernels.dispatch.without_autotuning`).

No GPU here, so each rank fakes what a GPU does: the backend rule answers ``"tune"``
(ask the autotuner) on the CPU, and the autotuner disagrees by rank — rank 0 has only
the torch products, rank 1 also a candidate (the same products computed in float64,
then rounded: correct, so it passes the cross-check, but not the same bits) that its
timer makes the faster. The ranks hold identical weights and gradients, as under DDP;
the test compares their weights after three steps, and checks that the fake really
makes the orthogonalisation differ between the ranks (so an equal result proves the
fix, not a vacuous fake).
"""

from __future__ import annotations

import torch

from dmuon.comm.testing import run_on_ranks

STEPS = 3


def _float64_ops():
    """Correct symmetric products with other rounding than torch's (computed in float64)."""
    from dmuon.kernels import SymmetricOps
    from dmuon.kernels.symmetric_ops import sym_mul_torch, sym_poly_torch, syrk_torch

    def syrk(X):
        return syrk_torch(X.double()).to(X.dtype)

    def sym_poly(A, b, c, a=0.0):
        return sym_poly_torch(A.double(), b, c, a).to(A.dtype)

    def sym_mul(A, B, a):
        return sym_mul_torch(A.double(), B.double(), a).to(A.dtype)

    return SymmetricOps("float64", syrk, sym_poly, sym_mul)


def _disagreeing_tuner(rank: int) -> None:
    """Make ``backend="auto"`` ask an autotuner on the CPU, one whose winner depends on
    the rank: rank 0 only knows the torch products, rank 1 also the float64 ones and
    times them faster (the reference is timed first)."""
    import dmuon.kernels.autotune as autotune
    import dmuon.kernels.dispatch as dispatch

    real_rule = dispatch.resolve_backend

    def rule(backend, **kw):
        return "tune" if backend == "auto" else real_rule(backend, **kw)

    candidates = {} if rank == 0 else {"float64": _float64_ops()}
    times = iter([2.0, 1.0] * 100)  # per problem: torch, then the candidate
    dispatch.resolve_backend = rule
    dispatch.triton_candidates = lambda: dict(candidates)
    dispatch._PLANS.clear()
    autotune._default = autotune.Autotuner(
        timer=lambda fn: next(times), cache_dir=None, device_name=lambda d: "fake-gpu"
    )


def _train_modes(rank: int, world: int, modes: list[str]) -> dict[str, dict[str, object]]:
    return {mode: _train(rank, world, mode) for mode in modes}


def _train(rank: int, world: int, mode: str) -> dict[str, object]:
    """Three steps of a two-layer model on gradients equal on every rank; the weights, and
    whether this rank's autotuner chose the other products."""
    import torch.distributed as dist

    from dmuon.kernels import default_autotuner, orthogonalize
    from dmuon.optim import DMuon

    _disagreeing_tuner(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 32, bias=False), torch.nn.Linear(32, 16, bias=False)
    )
    kw: dict = dict(mode=mode)
    if mode == "sign":
        kw.update(rule="sign_muon", local_polar=True)
    opt = DMuon(model.parameters(), lr=0.02, ns_compute_dtype="float32", **kw)
    assert opt.mode == mode
    for t in range(STEPS):
        g = torch.Generator().manual_seed(t)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)  # DDP's average: the same everywhere
        opt.step()
        opt.zero_grad()
    # outside the engine the autotuner answers as it would on a GPU: its winner by rank
    X = torch.randn(32, 24, generator=torch.Generator().manual_seed(9))
    tuned = orthogonalize(X, compute_dtype=torch.float32)
    winners = {d.winner for d in default_autotuner()._memory.values()}
    gathered = [None] * world
    dist.all_gather_object(gathered, tuned)
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "winners": sorted(winners),
        "tuned_differ": not torch.equal(gathered[0], gathered[1]),
    }


def test_ranks_whose_autotuners_disagree_keep_equal_weights():
    modes = ["single", "sign"]
    results = run_on_ranks(_train_modes, 2, args=(modes,), timeout=120)
    for mode in modes:
        first, second = results[0][mode], results[1][mode]
        # the fake works: the autotuner picks other products on rank 1, and they round
        # differently from rank 0's
        assert first["winners"] == ["torch"] and second["winners"] == ["float64"]
        assert first["tuned_differ"]
        for a, b in zip(first["weights"], second["weights"], strict=True):
            assert torch.equal(a, b), f"{mode}: the ranks' weights differ by {(a - b).abs().max()}"


def _replicated_whole(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Replicated mode on dp 2 × tp 2 with matrices replicated whole over tp, each stepped
    by every rank of its owner's tp row and all-gathered over dp to its own tp column:
    tp rank 1's autotuner picks the other products. The weights this rank ends with."""
    from test_tensor_parallel_pending_sums import run_pending

    _disagreeing_tuner(rank % 2)  # the tp rank (mode_mesh: tp is the inner dimension)
    return run_pending(rank, world, "replicated", True)[2]


def test_replicated_whole_matrices_stay_equal_over_tp_whatever_each_autotuner_picks():
    results = run_on_ranks(_replicated_whole, 4, timeout=240)
    for name in ("mix.weight", "head.weight"):  # the matrices replicated whole
        for rank in range(1, 4):
            a, b = results[0][name], results[rank][name]
            assert torch.equal(a, b), f"{name}: rank {rank} differs by {(a - b).abs().max()}"
