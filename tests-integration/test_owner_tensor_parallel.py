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
    SPLIT_TOLERANCE,
    STEPS,
    DeepMLP,
    clipped_reference,
    deep_batch,
    error,
    tp_deep_mlp,
)

from dmuon.comm import default_stats
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups
from dmuon.optim.engine.tensor_split import GATHER_STATS_NAME, STATS_NAME

RULES = {"muon": {}, "normuon": {"beta2": 0.9}, "dion3": {}}
# (rule, tp_path): Muon and NorMuon on both paths; Dion3's row selection needs the whole
# matrix, so its owner row gathers the shards whatever the path.
RUNS = [("muon", "gram"), ("muon", "gather"), ("normuon", "gram"), ("normuon", "gather")]
RUNS += [("dion3", "gram")]


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
        ded = ddp.dedicate(model, mesh)
        opt = DMuon(
            param_groups(model), rule=rule, tp_path=path, distributed=ded, **OPT, **RULES[rule]
        )
        assert opt.mode == "owner"
        default_stats().reset()
        norms: list[float] = []
        train(model, opt, ded, range(STEPS), row, norms)
        gram = default_stats()[STATS_NAME].payload_bytes
        gathered = default_stats()[GATHER_STATS_NAME].payload_bytes
        shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        owners = {n: ded.owner_of(n) for n in ded.names}
        out[rule, path] = (full(model), norms, owners, gram, gathered, shards, ded.all_reduced)
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
            got, norms, got_owners, gram, gathered, shards, all_reduced = out[rule, path]
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
    # the same message on every rank
    for case in ("reshard_after_forward", "fsdp first"):
        assert len({out[case] for out in results}) == 1, case
