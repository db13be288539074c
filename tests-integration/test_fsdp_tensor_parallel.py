"""FSDP2 over tensor parallelism in ``sharded`` mode: owners over ``dp``, shards over ``tp``.

A model parallelised with ``parallelize_module`` on the ``tp`` dimension of a
``dp × tp`` mesh and then ``fully_shard`` on ``dp`` holds its split matrices as
``(_StridedShard(0), Shard(0))`` (colwise) and ``(Shard(0), Shard(1))`` (rowwise)
DTensors. ``sharded`` mode all-to-alls each matrix's rows over ``dp`` to its owner,
which then holds its ``tp`` shard; the owner's ``tp`` row steps the matrix together
with the tensor-parallel Gram Newton–Schulz and the updates travel back over ``dp``.
The result must equal one process on the same global batch (4 ranks: dp 2 × tp 2, and
HSDP over tp on 8 ranks: dp_replicate 2 × dp_shard 2 × tp 2;
every split uneven), with clipping engaged, for Muon, NorMuon and Dion3 (whose row
selection needs the whole matrix: the owner's tp row gathers the shards); a NaN on one
rank's shard is agreed on by all four; the modes that cannot step the layout refuse it
on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensor_parallel_cases import (
    CLIP,
    OPT,
    SPLIT_TOLERANCE,
    STEPS,
    DeepMLP,
    clipped_reference,
    deep_batch,
    error,
    tp_deep_mlp,
    train_steps,
)

from dmuon.comm import default_stats
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups
from dmuon.optim.engine.tensor_split import GATHER_STATS_NAME, STATS_NAME

RULES = {"muon": {}, "normuon": {"beta2": 0.9}, "dion3": {}}  # dion3 gathers its shards
COLWISE = "(_StridedShard(dim=0, sf=2), Shard(dim=0)) on mesh dims ('dp', 'tp')"


def fsdp_tp_model(mesh, layers: str = "all"):
    """DeepMLP split over ``mesh['tp']`` (``layers="all"``; ``"half"``: fc1 and fc2 only,
    fc3 and fc4 whole, which FSDP2 then shards over the 1-D ``dp`` mesh), sharded by FSDP2
    over ``mesh['dp']`` layer by layer."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if layers == "all":
        model = tp_deep_mlp(mesh["tp"])
    else:
        model = DeepMLP()
        colwise = ColwiseParallel(output_layouts=Replicate())
        rowwise = RowwiseParallel(input_layouts=Replicate())
        parallelize_module(model, mesh["tp"], {"fc1": colwise, "fc2": rowwise})
    for layer in (model.fc1, model.fc2, model.fc3, model.fc4):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def half_of(t: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dp row ``row``'s half of global batch ``t`` (FSDP2 averages the two over dp)."""
    x, y = deep_batch(t)
    return x[8 * row : 8 * row + 8], y[8 * row : 8 * row + 8]


def run_sharded_dp_tp(rank, world, layers):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.optim import clip_grad_norm_

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row = mesh.get_coordinate()[0]
    out = {}
    for rule, options in RULES.items():
        model = fsdp_tp_model(mesh, layers)
        # mode detected; the Gram path on the shards (auto picks gather for tiny matrices)
        opt = DMuon(param_groups(model), rule=rule, tp_path="gram", **OPT, **options)
        placements = {n: repr(tuple(p.placements)) for n, p in model.named_parameters()}
        default_stats().reset()
        norms = []
        for t in range(STEPS):
            x, y = half_of(t, row)
            F.mse_loss(model(x), y).backward()
            norms.append(float(clip_grad_norm_(opt, CLIP)))
            opt.step()
            opt.zero_grad()
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        gram = default_stats()[STATS_NAME].payload_bytes
        gram += default_stats()[GATHER_STATS_NAME].payload_bytes
        out[rule] = (opt.engine.mode, full, norms, opt.engine.describe()["owners"], gram)
    out["placements"] = placements
    return out


@pytest.mark.parametrize("layers", ["all", "half"])
def test_sharded_mode_on_fsdp2_over_tensor_parallel_equals_one_process(layers):
    results = run_on_ranks(run_sharded_dp_tp, 4, args=(layers,), timeout=240)
    assert results[0]["placements"]["fc1.weight"] == COLWISE.split(" on ")[0], results[0]
    for rule, options in RULES.items():
        expected, norms = clipped_reference(rule, options)
        assert min(norms) > CLIP, f"{rule}: clipping never engaged: {norms}"
        owners = results[0][rule][3]
        assert set(owners.values()) == {0, 1}, owners  # both dp ranks own matrices
        for rank, out in enumerate(results):
            mode, got, got_norms, got_owners, gram = out[rule]
            assert mode == "sharded", (rule, rank, mode)
            assert got_owners == owners, (rule, rank)  # planned by whole shapes: same everywhere
            for a, b in zip(got_norms, norms, strict=True):
                assert abs(a - b) <= 1e-5 * b, f"{rule}, rank {rank}: norm {a} vs {b}"
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                assert diff <= SPLIT_TOLERANCE, f"{rule}, rank {rank}: {name} differs by {diff:.2e}"
            assert gram > 0, (rule, rank)  # the Gram (dion3: the shards) went over tp


HSDP_COLWISE = "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"


def run_hsdp_tp(rank, world):
    """HSDP over tensor parallelism: ``fully_shard`` on the 2-D ``dp_rep × dp_shard`` slice
    of a ``2 × 2 × 2`` mesh after ``parallelize_module`` on ``tp``; each of the four dp
    rows trains on a quarter of the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.optim import clip_grad_norm_

    names = ("dp_rep", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    rep, shard, _ = mesh.get_coordinate()
    row = 2 * rep + shard
    out = {}
    for rule in ("muon", "dion3"):  # dion3: the owner's tp row gathers the shards
        model = tp_deep_mlp(mesh["tp"])
        for layer in (model.fc1, model.fc2, model.fc3, model.fc4, model):
            fully_shard(layer, mesh=mesh["dp_rep", "dp_shard"])
        opt = DMuon(param_groups(model), rule=rule, tp_path="gram", **OPT)
        norms = []
        for t in range(STEPS):
            x, y = deep_batch(t)
            F.mse_loss(model(x[4 * row : 4 * row + 4]), y[4 * row : 4 * row + 4]).backward()
            norms.append(float(clip_grad_norm_(opt, CLIP)))
            opt.step()
            opt.zero_grad()
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[rule] = (opt.engine.mode, full, norms, repr(tuple(model.fc1.weight.placements)))
    return out


def test_sharded_mode_on_hsdp_over_tensor_parallel_equals_one_process():
    """``dp_replicate × dp_shard × tp`` = 2 × 2 × 2: the rows go to owners over ``dp_shard``
    in each replica (FSDP2 has averaged the gradients over both dp dimensions), the owner's
    tp row steps them; every replica computes the same update."""
    results = run_on_ranks(run_hsdp_tp, 8, timeout=300)
    for rule in ("muon", "dion3"):
        expected, norms = clipped_reference(rule, {})
        for rank, out in enumerate(results):
            mode, got, got_norms, placements = out[rule]
            assert (mode, placements) == ("sharded", HSDP_COLWISE), (rule, rank)
            for a, b in zip(got_norms, norms, strict=True):
                assert abs(a - b) <= 1e-5 * b, f"{rule}, rank {rank}: norm {a} vs {b}"
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                assert diff <= SPLIT_TOLERANCE, f"{rule}, rank {rank}: {name} differs by {diff:.2e}"


def run_nonfinite(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.optim import NonFiniteGradientError
    from dmuon.optim.matrix_split import local_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row = mesh.get_coordinate()[0]
    out = {}
    for nonfinite in ("raise", "skip_step"):
        model = fsdp_tp_model(mesh)
        opt = DMuon(param_groups(model), nonfinite=nonfinite, timeout=10, **OPT)
        errors = []
        for t in range(STEPS):
            x, y = half_of(t, row)
            F.mse_loss(model(x), y).backward()
            if t == 1 and dist.get_rank() == world - 1:  # after FSDP2's reduce-scatter
                local_tensor(model.fc1.weight.grad)[0, 0] = float("nan")
            try:
                opt.step()
            except NonFiniteGradientError as err:
                errors.append((t, err.ranks))
            opt.zero_grad()
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[nonfinite] = (errors, full, opt.skipped_steps)
    return out


def test_a_non_finite_shard_is_agreed_on_over_dp_and_tp():
    """Rank 3's shard of ``fc1.weight`` turns NaN: its owner's tp row must not enter a Gram
    all-reduce its peer skips. Every rank raises naming rank 3, or every rank skips (equal
    to one process that never saw that batch)."""
    results = run_on_ranks(run_nonfinite, 4, timeout=240)
    model = DeepMLP()
    train_steps(model, DMuon(param_groups(model), **OPT), [0, 2])
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for rank, out in enumerate(results):
        errors, _, _ = out["raise"]
        assert errors == [(1, [3])], (rank, errors)
        _, got, skipped = out["skip_step"]
        assert skipped == 1, (rank, skipped)
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = fsdp_tp_model(mesh)
    out = {
        mode: error(lambda m=mode: DMuon(param_groups(model), mode=m, **OPT))
        for mode in (
            "single",
            "replicated",
        )
    }
    return out


def test_single_and_replicated_refuse_fsdp2_over_tensor_parallel_on_every_rank():
    for rank, out in enumerate(run_on_ranks(run_refusals, 4, timeout=180)):
        for mode in ("single", "replicated"):
            msg = out[mode]
            assert msg is not None, f"rank {rank}, {mode}: no error"
            assert "'fc1.weight'" in msg and COLWISE in msg, (rank, mode, msg)
            assert "mode='sharded' does" in msg, (rank, mode, msg)
