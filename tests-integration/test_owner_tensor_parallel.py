"""Owner mode (``dedicate``) over a ``dp × tp`` mesh: owners over ``dp``, shards over ``tp``.

A model parallelised with ``parallelize_module`` on ``mesh["tp"]`` is dedicated with
``ddp.dedicate(model, mesh)`` on the 2-D mesh: the data-parallel dimension is the one the
tensor-parallel placements do not use. Owners are planned over the ``dp`` ranks of each
``tp`` column by the whole matrices' shapes (every column the same plan, though the
uneven splits give the columns different local shapes); each shard's gradient is
reduced over ``dp`` to its owner, the owner's ``tp`` row steps the matrix together
(Gram all-reduce over ``tp``, or gather/scatter, or Dion3's gather of the whole
matrix), and the new shards are broadcast over ``dp``. On 4 ranks (dp 2 × tp 2) with
DeepMLP (every split uneven; fc1 and fc2 have their small side sharded, fc3 and fc4
their long side; fc4, the output layer, is 6 × 15) the result equals one process on the
same global batches, with clipping engaged, for Muon, NorMuon and Dion3 on both paths.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from tensor_parallel_cases import (
    CLIP,
    OPT,
    SP_CLIP,
    SP_OPT,
    SPLIT_TOLERANCE,
    STEPS,
    DeepMLP,
    SequenceParallelNet,
    clipped_reference,
    deep_batch,
    error,
    sequence_batch,
    tp_deep_mlp,
)

from dmuon.comm import CommStats
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups
from dmuon.optim.engine.tensor_split import GATHER_STATS_NAME, STATS_NAME

RULES = {"muon": {}, "normuon": {"beta2": 0.9}, "dion3": {}}
# (rule, tp_path): Muon and NorMuon on both paths; Dion3's row selection needs the whole
# matrix, so its owner row gathers the shards whatever the path.
RUNS = [("muon", "gram"), ("muon", "gather"), ("normuon", "gram"), ("normuon", "gather")]
RUNS += [("dion3", "gram")]


class Recording(CommStats):
    """Byte counts, and the sequence of the collectives over ``tp``: the ranks of an owner's
    ``tp`` row must issue the same ones in the same order (or they would deadlock or pair a
    Gram matrix with another matrix's)."""

    def __init__(self) -> None:
        super().__init__()
        self.sequence: list[tuple[str, str, int]] = []

    def record_collective(self, name: str, op: str, *, nbytes: int, world_size: int) -> None:
        if name in (STATS_NAME, GATHER_STATS_NAME):
            self.sequence.append((name, op, nbytes))
        super().record_collective(name, op, nbytes=nbytes, world_size=world_size)


def half_of(t: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dp row ``row``'s half of global batch ``t`` (the reductions average the halves)."""
    x, y = deep_batch(t)
    return x[8 * row : 8 * row + 8], y[8 * row : 8 * row + 8]


def dp_tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def train(model, opt, ded, steps, row, norms=None) -> None:
    from dmuon.optim import clip_grad_norm_

    for t in steps:
        x, y = half_of(t, row)
        F.mse_loss(model(x), y).backward()
        if norms is not None:
            norms.append(float(clip_grad_norm_(opt, CLIP)))
        opt.step()
        opt.zero_grad()
    ded.wait()


def full(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def run_owner_dp_tp(rank, world):
    from dmuon.integrations import ddp

    mesh = dp_tp_mesh()
    row = mesh.get_coordinate()[0]
    out = {}
    for rule, path in RUNS:
        model = tp_deep_mlp(mesh["tp"])
        stats = Recording()
        ded = ddp.dedicate(model, mesh, stats=stats)
        opt = DMuon(
            param_groups(model),
            rule=rule,
            tp_path=path,
            distributed=ded,
            **dict(OPT, check_every=1),  # the rank-agreement checksum, over dp and tp
            **RULES[rule],
        )
        assert opt.mode == "owner"
        norms: list[float] = []
        train(model, opt, ded, range(STEPS), row, norms)
        gram = stats[STATS_NAME].payload_bytes
        gathered = stats[GATHER_STATS_NAME].payload_bytes
        shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        owners = {n: ded.owner_of(n) for n in ded.names}
        out[rule, path] = (
            full(model),
            norms,
            owners,
            (gram, gathered, stats.sequence),
            shards,
            ded.all_reduced,
        )
    return out


def test_owner_mode_on_a_dp_by_tp_mesh_equals_one_process():
    results = run_on_ranks(run_owner_dp_tp, 4, timeout=300)
    initial = {n: p.detach().clone() for n, p in DeepMLP().named_parameters()}
    references = {rule: clipped_reference(rule, options) for rule, options in RULES.items()}
    for rule, path in RUNS:
        expected, want_norms = references[rule]
        assert min(want_norms) > CLIP, f"{rule}: clipping never engaged: {want_norms}"
        moved = max((expected[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3, f"{rule}: the reference barely moved; the test would prove nothing"
        owners = results[0][rule, path][2]
        # planned by the whole shapes: one plan on every rank, both dp ranks own matrices
        assert set(owners) == {"fc1.weight", "fc2.weight", "fc3.weight", "fc4.weight"}
        assert set(owners.values()) == {0, 1}, owners
        for rank, out in enumerate(results):
            got, norms, got_owners, (gram, gathered, sequence), shards, all_reduced = out[
                rule, path
            ]
            # the owner's tp row (this rank and its tp partner, rank ^ 1) issued the same
            # collectives over tp in the same order
            assert sequence, (rule, path, rank)
            assert sequence == results[rank ^ 1][rule, path][3][2], (rule, path, rank)
            assert got_owners == owners, (rule, path, rank, got_owners, owners)
            # the tensor-parallel biases are all-reduced over dp by their local parts
            assert set(all_reduced) == {f"fc{i}.bias" for i in range(1, 5)}, all_reduced
            # the splits are uneven: the two tp columns hold different local shapes
            tp = rank % 2
            assert shards["fc1.weight"] == ((3, 12), (2, 12))[tp], shards
            assert shards["fc4.weight"] == ((6, 8), (6, 7))[tp], shards
            for a, b in zip(norms, want_norms, strict=True):
                assert abs(a - b) <= 1e-5 * b, f"{rule} ({path}), rank {rank}: norm {a} vs {b}"
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                # SPLIT_TOLERANCE (1e-6): the same global fp32 matrices as one process, the
                # polar factor from the shards' Gram matrices (or the gathered whole):
                # rounding apart, a few 1e-8 after 3 steps; a shard orthogonalised as if it
                # were the whole matrix is off by ~lr = 2e-2.
                assert diff <= SPLIT_TOLERANCE, (
                    f"{rule} ({path}), rank {rank}: {name} differs by {diff:.2e}"
                )
            # what went over tp: Gram matrices on the Gram path, shards on the gather path
            # (and always for Dion3); every dp row owns matrices, so every rank sends some
            if rule == "dion3" or path == "gather":
                assert gathered > 0, (rule, path, rank)
            if path == "gram" and rule != "dion3":
                assert gram > 0 and gathered == 0, (rule, path, rank, gram, gathered)


def run_owner_state_dict(rank, world):
    """Train 2 steps, take ``opt.state_dict()``, train a third; then a fresh model and
    dedication on the same layout, loaded with the weights and that state dict, trains
    the third step too: both must end equal."""
    from dmuon.integrations import ddp

    mesh = dp_tp_mesh()
    row = mesh.get_coordinate()[0]
    out = {}
    for rule in ("normuon", "dion3"):  # per-row state; whole-matrix state on the owner row
        model = tp_deep_mlp(mesh["tp"])
        ded = ddp.dedicate(model, mesh)
        opt = DMuon(param_groups(model), rule=rule, tp_path="gram", distributed=ded, **OPT)
        train(model, opt, ded, range(2), row)
        state = copy.deepcopy(opt.state_dict())
        weights = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
        train(model, opt, ded, range(2, 3), row)
        continued = full(model)

        fresh = tp_deep_mlp(mesh["tp"])
        with torch.no_grad():
            for n, p in fresh.named_parameters():
                p.to_local().copy_(weights[n])
        ded2 = ddp.dedicate(fresh, mesh)
        opt2 = DMuon(param_groups(fresh), rule=rule, tp_path="gram", distributed=ded2, **OPT)
        opt2.load_state_dict(state)
        train(fresh, opt2, ded2, range(2, 3), row)
        owned = [n for n in ded.names if ded.owner_of(n) == row]
        held = {
            n: tuple(opt.state[p]["momentum_buffer"].shape)
            for n, p in model.named_parameters()
            if n in ded.names
        }
        out[rule] = (continued, full(fresh), owned, held)
    return out


def test_the_optimizer_state_dict_round_trips_on_the_same_dp_by_tp_layout():
    for rank, out in enumerate(run_on_ranks(run_owner_state_dict, 4, timeout=300)):
        for rule, (continued, resumed, owned, held) in out.items():
            assert owned, (rule, rank)  # this rank's row owns state to save
            for name, want in continued.items():
                diff = (resumed[name] - want).abs().max().item()
                # the same arithmetic on the same values: bitwise, or rounding of the
                # collectives' order at most
                assert diff <= 1e-7, f"{rule}, rank {rank}: {name} resumed differs by {diff:.2e}"
            for name, shape in held.items():
                if name not in owned:
                    assert shape[-1] == 0 or 0 in shape, (rule, rank, name, shape)  # placeholder


def run_refusals(rank, world):
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import ddp, fsdp

    mesh = dp_tp_mesh()
    out = {}
    out["reshard_after_forward"] = error(
        lambda: ddp.dedicate(tp_deep_mlp(mesh["tp"]), mesh, reshard_after_forward=True)
    )
    # the dp slice of the mesh instead of the mesh: a 1-D group keeps plain owner mode
    out["dp slice"] = error(lambda: ddp.dedicate(tp_deep_mlp(mesh["tp"]), mesh["dp"]))
    model = tp_deep_mlp(mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])  # FSDP2 over TP first: the wrong order
    out["fsdp first"] = error(lambda: fsdp.dedicate(model, mesh))
    return out


def test_owner_mode_refuses_what_it_cannot_take_on_every_rank():
    results = run_on_ranks(run_refusals, 4, timeout=180)
    for rank, out in enumerate(results):
        msg = out["reshard_after_forward"]
        assert msg is not None, f"rank {rank}: reshard_after_forward was taken"
        assert "'fc1.weight'" in msg and "reshard_after_forward" in msg, (rank, msg)
        assert "(Shard(dim=0),) on mesh dims ('tp',)" in msg, (rank, msg)
        msg = out["fsdp first"]
        assert msg is not None, f"rank {rank}: an FSDP2-sharded model was dedicated"
        assert "'fc1.weight'" in msg and "('dp', 'tp')" in msg, (rank, msg)
        assert "dedicate() was called after fully_shard()" in msg, (rank, msg)
        msg = out["dp slice"]
        assert msg is not None, f"rank {rank}: a tensor-parallel model dedicated over dp alone"
        assert "'fc1.weight'" in msg and "not one of its dimensions" in msg, (rank, msg)
    # the same message on every rank
    for case in ("reshard_after_forward", "fsdp first", "dp slice"):
        assert len({out[case] for out in results}) == 1, case


# ------------------------------ tensor-parallel scalars: SequenceParallel norms, FSDP2


def sp_model(mesh):
    """SequenceParallelNet over ``mesh``: the norm's weight and bias are ``Replicate()``
    DTensors whose gradients are pending sums (``Partial``) over tp; fc1's bias is split."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = SequenceParallelNet()
    styles = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, mesh, styles)
    return model


def run_sequence_parallel_owner(rank, world):
    """dp row ``r`` takes batch element ``r``, each tp rank its half of the sequence; the
    scalars are all-reduced over dp (``ddp``), dedicated to owners (``ddp``,
    ``scalars="owner"``) or sharded by FSDP2 over dp (``fsdp``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from dmuon.integrations import ddp, fsdp
    from dmuon.optim import clip_grad_norm_

    mesh = dp_tp_mesh()
    row = mesh.get_coordinate()[0]
    out = {}
    for how in ("ddp", "ddp owner scalars", "fsdp"):
        model = sp_model(mesh["tp"])
        if how == "fsdp":
            ded = fsdp.dedicate(model, mesh)
            fully_shard(model, mesh=mesh["dp"], ignored_params=ded.params)
        else:
            scalars = "owner" if "owner" in how else "all_reduce"
            ded = ddp.dedicate(model, mesh, scalars=scalars)
        opt = DMuon(param_groups(model), distributed=ded, tp_path="gram", **SP_OPT)
        norms = []
        for t in range(STEPS):
            x, y = (
                distribute_tensor(v[row : row + 1], mesh["tp"], [Shard(1)]).to_local()
                for v in sequence_batch(t)
            )
            got = model(x)
            got = got.to_local() if hasattr(got, "to_local") else got
            # this row's half of the global mean: the reductions average the two rows
            F.mse_loss(got, y, reduction="sum").div(6 * 8).backward()
            norms.append(float(clip_grad_norm_(opt, SP_CLIP)))
            opt.step()
            opt.zero_grad()
        ded.wait()
        out[how] = (norms, full(model), sorted(ded.names))
    return out


def test_tensor_parallel_scalars_all_reduced_owned_or_fsdp_sharded_equal_one_process():
    """The norm's gradient is a pending sum over tp on each rank: reduced over dp by its
    local part, it keeps its ``Partial`` placement and the step carries the sum out, as in
    one process; clipping counts every shard once over dp × tp."""
    from dmuon.optim import clip_grad_norm_

    model = SequenceParallelNet()
    opt = DMuon(param_groups(model), **SP_OPT)
    want_norms = []
    for t in range(STEPS):
        x, y = sequence_batch(t)
        F.mse_loss(model(x), y, reduction="sum").div(y.numel()).backward()
        want_norms.append(float(clip_grad_norm_(opt, SP_CLIP)))
        opt.step()
        opt.zero_grad()
    assert min(want_norms) > SP_CLIP, want_norms
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank, out in enumerate(run_on_ranks(run_sequence_parallel_owner, 4, timeout=300)):
        for how, (norms, got, dedicated) in out.items():
            if how == "ddp owner scalars":
                assert dedicated == sorted(expected), (how, dedicated)
            else:
                assert dedicated == ["fc1.weight", "fc2.weight"], (how, dedicated)
            for a, b in zip(norms, want_norms, strict=True):
                assert abs(a - b) <= 1e-5 * b, f"{how}, rank {rank}: norm {a} vs {b}"
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                assert diff <= SPLIT_TOLERANCE, f"{how}, rank {rank}: {name} differs by {diff:.2e}"


# ------------------------------------------------ agreement: non-finite shards, models


def run_nonfinite(rank, world):
    """Rank 3's input holds a NaN in step 1 (of 3): its row's activations (the tp
    collectives of the forward) and its column's reductions carry it to owners on both
    dp rows. The ranks agree over dp and tp before any Gram all-reduce: with
    ``nonfinite="raise"`` every rank raises naming the ranks that saw it; with
    ``"skip_step"`` every rank skips, so the run equals one process without batch 1."""
    from dmuon.integrations import ddp
    from dmuon.optim import NonFiniteGradientError

    mesh = dp_tp_mesh()
    row = mesh.get_coordinate()[0]
    out = {}
    for nonfinite in ("raise", "skip_step"):
        model = tp_deep_mlp(mesh["tp"])
        ded = ddp.dedicate(model, mesh)
        opt = DMuon(param_groups(model), distributed=ded, nonfinite=nonfinite, timeout=30, **OPT)
        errors = []
        for t in range(STEPS):
            x, y = half_of(t, row)
            if t == 1 and rank == 3:
                x = x.clone()
                x[0, 0] = float("nan")
            F.mse_loss(model(x), y).backward()
            try:
                opt.step()
            except NonFiniteGradientError as err:
                errors.append((t, sorted(err.ranks)))
                break  # a raise ends this run
            opt.zero_grad()
        ded.wait()
        out[nonfinite] = (errors, full(model), opt.skipped_steps)
    return out


def test_a_non_finite_shard_is_agreed_on_over_dp_and_tp():
    model = DeepMLP()
    opt = DMuon(param_groups(model), **OPT)
    for t in (0, 2):  # one process that never saw batch 1
        x, y = deep_batch(t)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank, out in enumerate(run_on_ranks(run_nonfinite, 4, timeout=240)):
        errors, _, _ = out["raise"]
        assert len(errors) == 1 and errors[0][0] == 1, (rank, errors)
        assert errors[0][1], (rank, errors)  # the ranks holding it are named
        _, got, skipped = out["skip_step"]
        assert skipped == 1, (rank, skipped)
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_mismatch(rank, world):
    from torch import nn

    from dmuon.integrations import ddp
    from dmuon.optim import ModelMismatchError

    mesh = dp_tp_mesh()
    model = tp_deep_mlp(mesh["tp"])
    if rank == 3:
        model.extra = nn.Linear(4, 4)  # one rank's model has one more matrix
    try:
        ddp.dedicate(model, mesh)
    except ModelMismatchError as err:
        return str(err)
    return None


def test_a_model_that_differs_on_one_rank_is_refused_on_every_rank():
    """The plans are compared over the whole dp × tp mesh at once: the ranks of the other
    column (which plan over a dp group without rank 3) raise too, no rank hangs."""
    for rank, msg in enumerate(run_on_ranks(run_mismatch, 4, timeout=180)):
        assert msg is not None, f"rank {rank}: the mismatch went unnoticed"
        assert "'extra.weight" in msg and "rank 3" in msg, (rank, msg)
