"""Ranks that repeat the same orthogonalisation keep bitwise-equal weights whatever each
rank's autotuner would choose.

On CUDA, ``backend="auto"`` times its candidates in each process, so two ranks can pick
different products for the same shape (the Triton kernels and cuBLAS differ by about
2e-3 relative after a Gram call on an H200: ``benchmarks/results/gpu-check-*.json``).
In ``single`` mode under DDP every rank repeats the whole step on the same averaged
gradients, in ``sign`` mode every rank orthogonalises every matrix, a matrix replicated
whole over tp is stepped by every rank of its owner's tp row (replicated and owner mode),
and HSDP's replicas each step every matrix (sharded mode): replicas would drift apart.
The engines of those modes run the step without the autotuner (``Engine.products``:
:func:`dmuon.kernels.dispatch.without_autotuning`).

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


def _owner_whole(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Owner mode on dp 2 × tp 2: a matrix replicated whole over tp is stepped by every
    rank of its owner's tp row, then broadcast over dp in each tp column."""
    from test_tensor_parallel_pending_sums import run_pending

    _disagreeing_tuner(rank % 2)
    return run_pending(rank, world, "owner", True)[2]


def _sharded_hsdp(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Sharded mode under HSDP (2 replicas × 2 shards): each replica plans and steps its
    matrices within its shard group, so every matrix is orthogonalised once per replica;
    replica 1's autotuner picks the other products. The full weights this rank ends with."""
    from distributed_cases import OPT, batch, build, full_params, loss_of
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.optim import DMuon, param_groups

    _disagreeing_tuner(rank // 2)  # the replica
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build("gpt")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DMuon(param_groups(model), **OPT)
    assert opt.mode == "sharded", opt.mode
    for t in range(STEPS):
        loss_of("gpt", model, *batch("gpt", t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def test_owner_and_hsdp_replicas_stay_equal_whatever_each_autotuner_picks():
    """Owner mode's matrices replicated whole over tp, and sharded mode's HSDP replicas,
    repeat an orthogonalisation on several ranks too (before: 3e-8 apart over tp in owner
    mode, 5e-7 between the HSDP replicas, found by a review)."""
    owner = run_on_ranks(_owner_whole, 4, timeout=240)
    for name in ("mix.weight", "head.weight"):
        for rank in range(1, 4):
            a, b = owner[0][name], owner[rank][name]
            assert torch.equal(a, b), f"owner {name}: rank {rank} differs by {(a - b).abs().max()}"
    hsdp = run_on_ranks(_sharded_hsdp, 4, timeout=240)
    for name, a in hsdp[0].items():
        b = hsdp[2][name]  # rank 2: replica 1's first shard rank
        assert torch.equal(a, b), f"HSDP {name}: replica 1 differs by {(a - b).abs().max()}"
