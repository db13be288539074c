"""Tensor-parallel models: placements read, shards stepped in ``single`` mode, refusals.

A model parallelised with torch's public ``parallelize_module`` (``ColwiseParallel``:
``Shard(0)``, ``RowwiseParallel``: ``Shard(1)`` on the ``tp`` mesh dimension) is either
stepped correctly by the mode asked for or refused — on every rank, with an error
naming the parameter, its placements and the mode that takes it — and no rank hangs
(the harness' timeout would fail the test). FSDP2 over tensor parallelism:
``test_fsdp_tensor_parallel.py``. What sharded mode steps today (rows over one
mesh dimension) still equals one process, and so does ``single`` mode stepping every
matrix on its shards with the tensor-parallel Gram Newton–Schulz (no gather), for
every rule whose links all act on shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensor_parallel_cases import (
    CLIP,
    OPT,
    SP_CLIP,
    SP_OPT,
    SP_VALUE,
    SPLIT_TOLERANCE,
    STEPS,
    DeepMLP,
    SequenceParallelNet,
    clipped_reference,
    deep_batch,
    error,
    mode_mesh,
    sequence_batch,
    tp_deep_mlp,
    train_steps,
)
from torch import nn

from dmuon.comm import default_stats
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups
from dmuon.optim.engine.tensor_split import GATHER_STATS_NAME, STATS_NAME

# fp32 Newton–Schulz on the same global matrices in both runs; what differs is the
# order of a few sums (the all-to-all reassembles the rows, the Gram products are the
# same), so parameters agree to a few fp32 ulps per step after 3 steps.
TOLERANCE = 1e-5


class MLP(nn.Module):
    """fc1 (8 → 14) then fc2 (14 → 6): non-square, 14 rows/columns split 7 + 7."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc1 = nn.Linear(8, 14)
            self.fc2 = nn.Linear(14, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(16, 8, generator=g), torch.randn(16, 6, generator=g)


def tp_mlp(mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = MLP()
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


def run_refusals_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp, fsdp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tp_mlp(mesh)
    out = {}
    out["detected"] = error(lambda: DMuon(param_groups(model), **OPT))
    for mode in ("single", "replicated", "sharded"):
        out[mode] = error(lambda mode=mode: DMuon(param_groups(model), mode=mode, **OPT))
    out["sign"] = error(lambda: DMuon(param_groups(model), mode="sign", rule="sign_muon"))
    out["ddp.dedicate"] = error(lambda: ddp.dedicate(tp_mlp(mesh)))
    out["fsdp.dedicate"] = error(lambda: fsdp.dedicate(tp_mlp(mesh), mesh))
    return out


COLWISE = "(Shard(dim=0),) on mesh dims ('tp',)"
ROWWISE = "(Shard(dim=1),) on mesh dims ('tp',)"


def test_every_mode_but_single_refuses_a_tensor_parallel_mlp_over_all_ranks_on_every_rank():
    for rank, out in enumerate(run_on_ranks(run_refusals_tp, 2, timeout=120)):
        assert out["single"] is None, f"rank {rank}: single mode refused: {out['single']}"
        for mode in ("detected", "sharded"):
            msg = out[mode]
            assert msg is not None, f"rank {rank}, {mode}: no error"
            assert "'fc2.weight'" in msg and ROWWISE in msg, (rank, mode, msg)
            assert "mode='single' does, on the shards" in msg, (rank, mode, msg)
        msg = out["sign"]
        assert msg is not None, f"rank {rank}, sign: no error"
        assert "'fc1.weight'" in msg and COLWISE in msg, (rank, msg)
        # sharded mode steps fc1 (row shards) but not fc2: "leave mode unset" would only
        # move the refusal to fc2; single mode steps both
        assert "mode='sign'" in msg and "but not 'fc2.weight'" in msg and ROWWISE in msg, msg
        assert msg.endswith("pass mode='single'"), (rank, msg)
        assert "leave mode unset" not in msg, (rank, msg)
        # replicated mode steps shards with owners over *another* group (dp × tp): over
        # the tp ranks themselves it is refused (more in the replicated tests below)
        msg = out["replicated"]
        assert msg is not None, f"rank {rank}, replicated: no error"
        assert "'fc1.weight'" in msg and COLWISE in msg, (rank, msg)
        assert "plans owners over ranks [0, 1]" in msg, (rank, msg)
        for how in ("ddp.dedicate", "fsdp.dedicate"):
            msg = out[how]
            assert msg is not None, f"rank {rank}, {how}: no error"
            assert "'fc1.weight'" in msg and COLWISE in msg, (rank, how, msg)


def reference() -> dict[str, torch.Tensor]:
    model = MLP()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        x, y = batch(t)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_colwise_sharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = MLP()
    colwise = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, {"fc1": colwise, "fc2": colwise})
    opt = DMuon(param_groups(model), **OPT)
    assert opt.mode == "sharded"
    for t in range(STEPS):
        x, y = batch(t)  # every TP rank sees the whole global batch
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def test_colwise_rows_in_sharded_mode_equal_one_process():
    expected = reference()
    for rank, got in enumerate(run_on_ranks(run_colwise_sharded, 2, timeout=120)):
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


SPLIT_RULES = {
    "muon": {},
    "scion": {"radius": 2.0},
    "muon2": {},
    "mona": {},
    "normuon": {"beta2": 0.9},
}


def deep_reference(rule: str, options: dict) -> dict[str, torch.Tensor]:
    model = DeepMLP()
    train_steps(model, DMuon(param_groups(model), rule=rule, **OPT, **options), range(STEPS))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


PATH_RULES = ("muon", "normuon")  # the gather and auto paths: the polar factor only changes


def run_single_on_shards(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    runs = [(rule, "gram") for rule in SPLIT_RULES]
    runs += [(rule, path) for path in ("gather", "auto") for rule in PATH_RULES]
    for rule, path in runs:
        model = tp_deep_mlp(mesh)
        shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        opt = DMuon(
            param_groups(model), mode="single", rule=rule, tp_path=path, **OPT, **SPLIT_RULES[rule]
        )
        train_steps(model, opt, range(STEPS - 1))  # every TP rank sees the whole batch
        default_stats().reset()
        train_steps(model, opt, range(STEPS - 1, STEPS))
        gram = default_stats()[STATS_NAME].payload_bytes  # the last step's
        gathered = default_stats()[GATHER_STATS_NAME].payload_bytes
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[rule, path] = (full, shards, gram, gathered)
    return out


def gram_bytes(m: int, n: int, split_dim: int, steps: int = 5) -> int:
    """What the tensor-parallel Gram path all-reduces for one fp32 matrix (kernels docstring):
    the Gram matrix of the unsplit side ``s`` at the start and at each restart — one
    restart when ``s`` is the short side, one per step after the first when it is the
    long one — one max, and one sum of the squared norm with the split size appended."""
    s = n if split_dim == -2 else m
    restarts = 1 if s <= min(m, n) else steps - 1
    return (1 + restarts) * s * s * 4 + 4 + 2 * 4


def normalisation_bytes(rule: str, m: int, n: int, split_dim: int) -> int:
    """What NorMuon's and AdaMuon's normalisations add: the Frobenius rescale's two squared
    norms, and (NorMuon, split by columns) each row's sum of squares."""
    if rule not in ("normuon", "adamuon"):
        return 0
    rows = m * 4 if rule == "normuon" and split_dim == -1 else 0
    return 2 * 4 + rows


def gather_bytes(m: int, n: int, split_dim: int, world: int = 2) -> int:
    """What the gather path hands to the all-gather for one fp32 matrix: this rank's shard
    padded to the largest."""
    split, g = (m, n) if split_dim == -2 else (n, m)
    return -(-split // world) * g * 4


def test_single_mode_steps_tensor_parallel_shards_like_one_process():
    """Every splitting rule on the Gram path; Muon and NorMuon also gathering every matrix
    (``tp_path="gather"``) and by the cost model's choice (``"auto"``): all equal one
    process, and what travels is what each path's formula says."""
    from dmuon.comm import tensor_parallel_path

    results = run_on_ranks(run_single_on_shards, 2, timeout=240)
    initial = {n: p.detach().clone() for n, p in DeepMLP().named_parameters()}
    layers = [(5, 12, -2), (6, 5, -1), (15, 6, -2), (6, 15, -1)]  # DeepMLP's table
    auto = {a: tensor_parallel_path(*a, 2).path for a in layers}
    assert set(auto.values()) == {"gather"}, auto  # tiny matrices: one collective is cheaper
    for (rule, path), _ in results[0].items():
        expected = deep_reference(rule, SPLIT_RULES[rule])
        moved = max((expected[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3, f"{rule}: the reference barely moved; the test would prove nothing"
        chosen = {a: path if path != "auto" else auto[a] for a in layers}
        want_gram = sum(
            normalisation_bytes(rule, *a) + (gram_bytes(*a) if chosen[a] == "gram" else 0)
            for a in layers
        )
        want_gather = sum(gather_bytes(*a) for a in layers if chosen[a] == "gather")
        for rank, out in enumerate(results):
            got, shards, gram, gathered = out[rule, path]
            assert (gram, gathered) == (want_gram, want_gather), (rule, path, rank, gram, gathered)
            # the splits are uneven: the ranks' shards differ
            want_rows = (3, 2)[rank], (8, 7)[rank]
            assert shards["fc1.weight"][0] == want_rows[0], shards
            assert shards["fc3.weight"][0] == want_rows[1], shards
            assert shards["fc2.weight"][1] == (3, 2)[rank], shards
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                assert diff <= SPLIT_TOLERANCE, (
                    f"{rule} ({path}), rank {rank}: {name} differs by {diff:.2e}"
                )


# Rules with a link that needs the whole matrix (Rule.splits false): the shards are
# all-gathered over tp and every rank of the group runs the rule on the whole matrix.
WHOLE_RULES = {"dion3": {}, "dion2": {}, "musec": {}, "numuon": {}}


def run_whole_matrix_rules(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for rule, options in WHOLE_RULES.items():
        model = tp_deep_mlp(mesh)
        opt = DMuon(param_groups(model), mode="single", rule=rule, **OPT, **options)
        default_stats().reset()
        train_steps(model, opt, range(STEPS))
        state = {
            n: tuple(opt.state[p]["momentum_buffer"].shape)
            for n, p in model.named_parameters()
            if "momentum_buffer" in opt.state[p]
        }
        gathered = default_stats()[GATHER_STATS_NAME].payload_bytes
        out[rule] = (
            {n: p.detach().full_tensor() for n, p in model.named_parameters()},
            state,
            gathered,
        )
    return out


def test_rules_that_need_the_whole_matrix_gather_the_shards_and_equal_one_process():
    """Dion2/Dion3's row selection, Musec's spectral clip and NuMuon's subspace need the
    whole matrix: each rank of the group gathers the shards of its
    gradient, runs the rule on the whole matrix (whole state, the same on every rank) and
    keeps its shard of the update. Never a shard treated as the whole matrix."""
    layers = [(5, 12, -2), (6, 5, -1), (15, 6, -2), (6, 15, -1)]  # DeepMLP's table
    results = run_on_ranks(run_whole_matrix_rules, 2, timeout=240)
    initial = {n: p.detach().clone() for n, p in DeepMLP().named_parameters()}
    for rule, options in WHOLE_RULES.items():
        expected = deep_reference(rule, options)
        moved = max((expected[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3, f"{rule}: the reference barely moved; the test would prove nothing"
        for rank, out in enumerate(results):
            got, state, gathered = out[rule]
            assert state["fc1.weight"] == (5, 12), (rule, state)  # whole state on each rank
            assert gathered >= STEPS * sum(gather_bytes(*a) for a in layers), (rule, gathered)
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                assert diff <= SPLIT_TOLERANCE, f"{rule}, rank {rank}: {name} differs by {diff:.2e}"


def run_muonbp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tp_deep_mlp(mesh)
    opt = DMuon(param_groups(model), mode="single", rule="muonbp", period=2, **OPT)
    gathered = []
    for t in range(STEPS):
        default_stats().reset()
        train_steps(model, opt, range(t, t + 1))
        stats = default_stats().as_dict()  # the Gram path's sums and the gathers over tp
        gathered.append(
            sum(stats.get(k, {}).get("payload_bytes", 0) for k in (STATS_NAME, GATHER_STATS_NAME))
        )
    state = {
        n: tuple(opt.state[p]["momentum_buffer"].shape)
        for n, p in model.named_parameters()
        if "momentum_buffer" in opt.state[p]
    }
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}, state, gathered


def test_muonbp_blocks_are_the_shards_and_block_steps_send_nothing():
    """MuonBP as its paper runs it under tensor parallelism: the blocks are the shards. A
    block step (steps 1 and 3 of period 2) orthogonalises each rank's shard alone and
    sends nothing over ``tp``; the full step (step 2) takes the split path. Equal to one
    process whose blocks are those shards (rows for the colwise layers, columns for the
    rowwise ones: the same near-equal cut on 2 ranks), with the momentum held by shards."""
    model = DeepMLP()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows, cols = [model.fc1.weight, model.fc3.weight], [model.fc2.weight, model.fc4.weight]
    scalars = [g for g in param_groups(model) if g.get("rule") == "scalar"]
    groups = [
        {"params": rows, "param_names": ["fc1.weight", "fc3.weight"], "row_blocks": 2},
        {
            "params": cols,
            "param_names": ["fc2.weight", "fc4.weight"],
            "row_blocks": 1,
            "col_blocks": 2,
        },
        *scalars,
    ]
    train_steps(model, DMuon(groups, rule="muonbp", period=2, **OPT), range(STEPS))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max((expected[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-3
    for rank, (got, state, gathered) in enumerate(run_on_ranks(run_muonbp, 2, timeout=180)):
        assert state["fc1.weight"] == ((3, 2)[rank], 12), state  # the shard's momentum
        assert gathered[0] == 0 and gathered[2] == 0 and gathered[1] > 0, gathered
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_save_and_continue(rank, world, path, rule):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import checkpoint

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tp_deep_mlp(mesh)
    opt = DMuon(param_groups(model), mode="single", rule=rule, **OPT)
    train_steps(model, opt, range(2))
    checkpoint.save(path, model, opt)
    train_steps(model, opt, range(2, 3))
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def run_load_and_continue(rank, world, path, rule):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import checkpoint

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tp_deep_mlp(mesh)
    opt = DMuon(param_groups(model), mode="single", rule=rule, **OPT)
    checkpoint.load(path, model, opt)
    train_steps(model, opt, range(2, 3))
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


# NorMuon: per-row state too; Dion3: whole state on every rank of the group
@pytest.mark.parametrize("rule", ["muon", "normuon", "dion3"])
def test_dcp_checkpoint_of_shards_resumes_on_the_shards_and_in_one_process(tmp_path, rule):
    from dmuon.integrations import checkpoint

    path = str(tmp_path / "tp")
    continued = run_on_ranks(run_save_and_continue, 2, args=(path, rule), timeout=180)
    resumed = run_on_ranks(run_load_and_continue, 2, args=(path, rule), timeout=180)
    model = DeepMLP()  # one process, unsplit: DCP reassembles the shards' state
    opt = DMuon(param_groups(model), rule=rule, **OPT)
    checkpoint.load(path, model, opt)
    train_steps(model, opt, range(2, 3))
    single = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = DeepMLP()  # the weights only, with a fresh optimizer: what lost state looks like
    checkpoint.load(path, fresh, DMuon(param_groups(fresh), rule=rule, **OPT))
    forgetful = DMuon(param_groups(fresh), rule=rule, **OPT)
    train_steps(fresh, forgetful, range(2, 3))
    want = continued[0]
    lost = max((fresh.state_dict()[n] - w).abs().max().item() for n, w in want.items())
    assert lost > 100 * SPLIT_TOLERANCE, "the optimizer state made no difference: void test"
    for what, got in [("rank 0", resumed[0]), ("rank 1", resumed[1]), ("one process", single)]:
        for name, w in want.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"resumed on {what}: {name} differs by {diff:.2e}"


def run_fsdp2_single(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = DeepMLP()
    for layer in (model.fc1, model.fc2, model.fc3, model.fc4):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DMuon(param_groups(model), mode="single", **OPT)
    for t in range(STEPS):
        x, y = deep_batch(t)
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        F.mse_loss(model(x[rows]), y[rows]).backward()  # FSDP2 averages over the ranks
        opt.step()
        opt.zero_grad()
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def test_fsdp2_rows_stepped_on_their_shards_in_single_mode_equal_one_process():
    """FSDP2's ``Shard(0)`` rows are a split like a colwise layer's: ``single`` mode steps
    them where they are, the Gram matrix all-reduced over the FSDP2 group (sharded
    mode would all-to-all the rows to one owner instead)."""
    expected = deep_reference("muon", {})
    for rank, got in enumerate(run_on_ranks(run_fsdp2_single, 2, timeout=120)):
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_conv_single(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 6, 6))  # materialise the lazy layer
    fully_shard(model, mesh=mesh)
    return error(lambda: DMuon(param_groups(model), mode="single"))


def test_a_sharded_conv_weight_is_refused_in_single_mode_on_every_rank():
    """Only a 2-D matrix is stepped on its shards: FSDP2's rows of a 4-D conv weight
    (flattened to a matrix per group) would be orthogonalised as if whole."""
    for rank, msg in enumerate(run_on_ranks(run_conv_single, 2, timeout=120)):
        assert msg is not None, f"rank {rank}: the conv weight's shard was stepped as a matrix"
        assert "'0.weight'" in msg and "mode='single'" in msg, (rank, msg)
        assert "mode='sharded' does" in msg and "steps it on its shards" not in msg, (rank, msg)


# ------------------------------------------------ replicated mode on a dp × tp mesh

REPLICATED_RULES = {"muon": {}, "normuon": {"beta2": 0.9}, "dion3": {}}


def run_replicated_dp_tp(rank, world):
    """dp 2 × tp 2: each dp row takes half of each global batch, averages its gradients
    over ``dp`` (what DDP would do), clips with DMuon and steps in replicated mode with
    owners over ``dp``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations.hf import gather_full_state_dict, missing_state
    from dmuon.optim import clip_grad_norm_
    from dmuon.optim.matrix_split import local_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_group()
    row = mesh.get_coordinate()[0]
    out = {}
    for rule, options in REPLICATED_RULES.items():
        model = tp_deep_mlp(mesh["tp"])
        opt = DMuon(
            param_groups(model),
            mode="replicated",
            process_group=dp,
            rule=rule,
            tp_path="gram",  # the shards' path (the default picks gather for these tiny ones)
            **OPT,
            **options,
        )
        norms = []
        default_stats().reset()
        for t in range(STEPS):
            x, y = deep_batch(t)
            half = slice(8 * row, 8 * row + 8)
            F.mse_loss(model(x[half]), y[half]).backward()
            for p in model.parameters():  # DDP's average over dp, shard by shard
                g = local_tensor(p.grad)
                dist.all_reduce(g, group=dp)
                g.div_(2)
            norms.append(float(clip_grad_norm_(opt, CLIP)))
            opt.step()
            opt.zero_grad()
        owners = opt.engine.describe()["owners"]
        gram = default_stats()[STATS_NAME].payload_bytes
        gram += default_stats()[GATHER_STATS_NAME].payload_bytes  # dion3 gathers its shards
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[rule] = (full, norms, owners, gram)

    # The Trainer's full state dict: each owner's tp row holds the state of a split
    # matrix shard by shard; every rank gathers its tp column's shards from the owners.
    def plain(state):  # DTensor state (AdamW's of tp-sharded vectors) as its local part
        return {i: {k: local_tensor(v).clone() for k, v in st.items()} for i, st in state.items()}

    local = plain(opt.state_dict()["state"])
    full = gather_full_state_dict(opt)
    opt.load_state_dict(full)  # a rank's full dict loads back: its shapes are the shards'
    out["hf"] = (mesh.get_coordinate(), local, plain(full["state"]), missing_state(full))
    return out


def test_replicated_mode_on_a_dp_by_tp_mesh_equals_one_process():
    results = run_on_ranks(run_replicated_dp_tp, 4, timeout=240)
    for rule, options in REPLICATED_RULES.items():
        expected, norms = clipped_reference(rule, options)
        assert min(norms) > CLIP, f"{rule}: clipping never engaged: {norms}"
        owners = results[0][rule][2]
        # the plan weighs whole matrices: the same owners on every rank, both dp ranks used
        assert set(owners.values()) == {0, 1}, owners
        for rank, out in enumerate(results):
            got, got_norms, got_owners, gram = out[rule]
            assert got_owners == owners, (rule, rank)
            for a, b in zip(got_norms, norms, strict=True):
                assert abs(a - b) <= 1e-5 * b, f"{rule}, rank {rank}: norm {a} vs {b}"
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                assert diff <= SPLIT_TOLERANCE, f"{rule}, rank {rank}: {name} differs by {diff:.2e}"
            # the Gram matrices (or dion3's shards) went over tp (every dp rank owns some)
            assert gram > 0, (rule, rank)

    # gather_full_state_dict: in a tp column, a matrix's state is held by one dp rank (its
    # owner; the others hold placeholders) and every rank of the column gathers exactly
    # the owner's shard; AdamW's state, held everywhere, stays each rank's own.
    def holds(st):
        return any(v.numel() for k, v in st.items() if k != "step")

    gathered = 0
    for coord, own, full, missing in (out["hf"] for out in results):
        assert missing == [], (coord, missing)
        column = [o["hf"][1] for o in results if o["hf"][0][1] == coord[1]]
        for idx, st in full.items():
            holders = [loc for loc in column if holds(loc[idx])]
            source = holders[0] if len(holders) == 1 else own
            assert len(holders) in (1, len(column)), (coord, idx, len(holders))
            gathered += len(holders) == 1 and not holds(own[idx])
            for key, value in st.items():
                assert torch.equal(value, source[idx][key]), (coord, idx, key)
    assert gathered > 0  # some matrices' state came from another rank


def run_replicated_refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # owners planned over the very ranks that hold the shards
    out["tp over the world"] = error(
        lambda: DMuon(param_groups(tp_mlp(tp)), mode="replicated", **OPT)
    )
    model = DeepMLP()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    out["FSDP2 rows"] = error(lambda: DMuon(param_groups(model), mode="replicated", **OPT))
    return out


def test_replicated_mode_refuses_shards_split_over_its_own_group_on_every_rank():
    for rank, out in enumerate(run_on_ranks(run_replicated_refusals, 2, timeout=120)):
        for case in ("tp over the world", "FSDP2 rows"):
            msg = out[case]
            assert msg is not None, f"rank {rank}: {case} was stepped"
            assert "plans owners over ranks [0, 1]" in msg, (rank, case, msg)
            assert "process_group=mesh['dp'].get_group()" in msg, (rank, case, msg)


# ------------------------------------------- a non-finite shard: every rank agrees


def run_nonfinite_shard(rank, world, mode):
    """A NaN in one rank's shard of ``fc1.weight``'s gradient in step 2 (of 3). The ranks
    of its tp group must agree before any of them enters a Gram all-reduce: with
    ``nonfinite="raise"`` every rank raises naming the rank; with ``"skip_step"`` every
    rank skips, so the run equals one process that never saw that batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.optim import NonFiniteGradientError
    from dmuon.optim.matrix_split import local_tensor

    bad = world - 1
    if mode == "single":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        dp, row, rows = None, 0, 1
        kw = {"mode": "single"}
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        dp, row, rows = mesh["dp"].get_group(), mesh.get_coordinate()[0], 2
        kw = {"mode": "replicated", "process_group": dp}
    out = {}
    for nonfinite in ("raise", "skip_step"):
        model = tp_deep_mlp(mesh if mode == "single" else mesh["tp"])
        opt = DMuon(param_groups(model), nonfinite=nonfinite, timeout=10, **kw, **OPT)
        errors = []
        for t in range(STEPS):
            x, y = deep_batch(t)
            n = 16 // rows
            F.mse_loss(model(x[n * row : n * row + n]), y[n * row : n * row + n]).backward()
            for p in model.parameters():
                g = local_tensor(p.grad)
                if dp is not None:  # DDP's average over dp
                    dist.all_reduce(g, group=dp)
                    g.div_(2)
            if t == 1 and dist.get_rank() == bad:
                local_tensor(model.fc1.weight.grad)[0, 0] = float("nan")
            try:
                opt.step()
            except NonFiniteGradientError as err:
                errors.append((t, err.ranks))
            opt.zero_grad()
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out[nonfinite] = (errors, full, opt.skipped_steps)
    return out


@pytest.mark.parametrize(("mode", "world"), [("single", 2), ("replicated", 4)])
def test_a_non_finite_shard_is_agreed_on_by_its_tensor_parallel_group(mode, world):
    results = run_on_ranks(run_nonfinite_shard, world, args=(mode,), timeout=240)
    # the reference: one process that never saw batch 1
    model = DeepMLP()
    train_steps(model, DMuon(param_groups(model), **OPT), [0, 2])
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = world - 1
    for rank, out in enumerate(results):
        errors, _, _ = out["raise"]
        assert errors == [(1, [bad])], (rank, errors)  # the NaN came after the dp average
        _, got, skipped = out["skip_step"]
        assert skipped == 1, (rank, skipped)
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_clipped_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.optim import clip_grad_norm_

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tp_deep_mlp(mesh)
    opt = DMuon(param_groups(model), mode="single", **OPT)
    norms = []
    for t in range(STEPS):
        x, y = deep_batch(t)
        F.mse_loss(model(x), y).backward()
        norms.append(clip_grad_norm_(opt, 0.1).item())
        opt.step()
        opt.zero_grad()
    return norms, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def test_clip_grad_norm_in_single_mode_counts_each_shard_once():
    """Split matrices' shards (and plain biases every rank holds) counted once over the
    world: the norm and the clipped run equal torch's ``clip_grad_norm_`` in one process."""
    model = DeepMLP()
    opt = DMuon(param_groups(model), **OPT)
    want = []
    for t in range(STEPS):
        x, y = deep_batch(t)
        F.mse_loss(model(x), y).backward()
        want.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item())
        opt.step()
        opt.zero_grad()
    assert min(want) > 0.1, want  # clipping acts at every step
    for rank, (norms, got) in enumerate(run_on_ranks(run_clipped_tp, 2, timeout=120)):
        assert norms == pytest.approx(want, rel=1e-5), (rank, norms, want)
        for name, w in model.named_parameters():
            diff = (got[name] - w.detach()).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


# ------------------------------------------- SequenceParallel norms: pending sums


def run_sequence_parallel(rank, world, by="norm"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from dmuon.optim import clip_grad_norm_, clip_grad_value_

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = SequenceParallelNet()
    styles = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, mesh, styles)
    opt = DMuon(param_groups(model), mode="single", **SP_OPT)
    norms, partial = [], []
    for t in range(STEPS):
        x, y = (distribute_tensor(v, mesh, [Shard(1)]).to_local() for v in sequence_batch(t))
        out = model(x)
        F.mse_loss(out.to_local() if hasattr(out, "to_local") else out, y, reduction="sum").div(
            2 * 6 * 8
        ).backward()
        partial = [n for n, p in model.named_parameters() if "Partial" in repr(p.grad.placements)]
        if by == "norm":
            norms.append(float(clip_grad_norm_(opt, SP_CLIP)))
        else:
            clip_grad_value_(opt, SP_VALUE)
        opt.step()
        opt.zero_grad()
    return partial, norms, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("by", ["norm", "value"])
def test_sequence_parallel_norms_pending_sums_clip_and_step_like_one_process(by):
    """``clip_grad_norm_`` carries out the pending sums of a ``SequenceParallel`` norm's
    gradient before taking its norm (each rank's local part is only its share of the
    sequence: counting it as a shard gave 0.9039 for 0.9079, and steps off by 1e-4);
    ``clip_grad_value_`` before clamping (in-place ``clamp_`` on the Partial gradient
    raised, after the plain gradients had been clamped)."""
    from dmuon.optim import clip_grad_norm_

    model = SequenceParallelNet()
    opt = DMuon(param_groups(model), **SP_OPT)
    want_norms, clamped = [], 0
    for t in range(STEPS):
        x, y = sequence_batch(t)
        F.mse_loss(model(x), y, reduction="sum").div(y.numel()).backward()
        if by == "norm":
            want_norms.append(float(clip_grad_norm_(opt, SP_CLIP)))
        else:
            clamped += sum(int((p.grad.abs() > SP_VALUE).sum()) for p in model.parameters())
            torch.nn.utils.clip_grad_value_(model.parameters(), SP_VALUE)
        opt.step()
        opt.zero_grad()
    assert by == "norm" or clamped > 0, "clip_grad_value_ clamped nothing"
    for rank, (partial, norms, got) in enumerate(
        run_on_ranks(run_sequence_parallel, 2, args=(by,), timeout=120)
    ):
        assert partial == ["norm.weight", "norm.bias"], (rank, partial)  # the case under test
        for a, b in zip(norms, want_norms, strict=True):
            assert abs(a - b) <= 1e-5 * b, f"rank {rank}: norm {a} vs {b}"
        for name, p in model.named_parameters():
            diff = (got[name] - p.detach()).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


# Matrices with a dimension smaller than the tensor-parallel group: torch.chunk (and
# DTensor's Shard) gives rank 1 of 2 an empty shard, (1, 8) split by rows and (6, 1) by
# columns; (5, 4) split 3 + 2 beside them.
EMPTY_SHARDS = (((1, 8), 0), ((6, 1), 1), ((5, 4), 0))


def empty_shard_grads(t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(400 + t)
    return [torch.randn(shape, generator=g) for shape, _ in EMPTY_SHARDS]


def empty_shard_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(399)
    return [torch.randn(shape, generator=g) for shape, _ in EMPTY_SHARDS]


def run_empty_shards(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    params = [
        nn.Parameter(distribute_tensor(w, mesh, [Shard(d)]))
        for w, (_, d) in zip(empty_shard_weights(), EMPTY_SHARDS, strict=True)
    ]
    opt = DMuon(params, mode="single", tp_path=path, **OPT)
    for t in range(STEPS):
        for p, g, (_, d) in zip(params, empty_shard_grads(t), EMPTY_SHARDS, strict=True):
            p.grad = distribute_tensor(g, mesh, [Shard(d)])
        opt.step()
    return [tuple(p.to_local().shape) for p in params], [p.detach().full_tensor() for p in params]


@pytest.mark.parametrize("path", ["gram", "gather"])
def test_empty_tensor_parallel_shards_take_part_in_the_step_and_equal_one_process(path):
    """A rank whose shard of a matrix is empty (a dimension smaller than the group) steps
    it with the others, on both paths, instead of refusing it alone (which left the
    other ranks waiting in the Gram all-reduce)."""
    results = run_on_ranks(run_empty_shards, 2, args=(path,), timeout=120)
    params = [nn.Parameter(w) for w in empty_shard_weights()]
    opt = DMuon(params, **OPT)
    for t in range(STEPS):
        for p, g in zip(params, empty_shard_grads(t), strict=True):
            p.grad = g
        opt.step()
    assert results[1][0][:2] == [(0, 8), (6, 0)], results[1][0]  # the empty shards
    for rank, (_, got) in enumerate(results):
        for i, (p, w) in enumerate(zip(params, empty_shard_weights(), strict=True)):
            assert (p.detach() - w).abs().max().item() > 1e-3  # the reference moved
            diff = (got[i] - p.detach()).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"rank {rank}, matrix {i}: differs by {diff:.2e}"


class NarrowMLP(nn.Module):
    """fc1 (8 → 1) then fc2 (1 → 5): one row, one column (and fc1's one bias) over 2
    ranks."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            self.fc1 = nn.Linear(8, 1)
            self.fc2 = nn.Linear(1, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def narrow_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + t)
    return torch.randn(16, 8, generator=g), torch.randn(16, 5, generator=g)


NARROW_CLIP = 0.05  # below every step's gradient norm (≈ 0.7–1.0): every step is clipped


def run_narrow_tp(rank, world, mode):
    """``single`` mode on a tp mesh of 2; owner mode (``dedicate``) and replicated mode
    (owners over dp) on dp 2 × tp 2, each dp row half of every batch."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dmuon.integrations import ddp
    from dmuon.optim import clip_grad_norm_

    mesh, tp, rows, row = mode_mesh(mode, world)
    model = NarrowMLP()
    parallelize_module(
        model,
        tp,
        {
            "fc1": ColwiseParallel(output_layouts=Replicate()),
            "fc2": RowwiseParallel(input_layouts=Replicate()),
        },
    )
    ded = ddp.dedicate(model, mesh) if mode == "owner" else None
    dp = mesh["dp"].get_group() if mode == "replicated" else None
    opt = DMuon(param_groups(model), mode=mode, distributed=ded, process_group=dp, **OPT)
    placements, norms = [], []
    for t in range(STEPS):
        x, y = narrow_batch(t)
        h = len(x) // rows
        F.mse_loss(model(x[h * row : h * row + h]), y[h * row : h * row + h]).backward()
        placements.append({n: str(p.grad.placements) for n, p in model.named_parameters()})
        if dp is not None:  # DDP's average over dp, shard by shard
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad.to_local(), group=dp)
                p.grad.to_local().div_(2)
        norms.append(float(clip_grad_norm_(opt, NARROW_CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=bool(t % 2))  # zeroed gradients, then none
    if ded is not None:
        ded.wait()
    full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return placements, full, norms


@pytest.mark.parametrize(("mode", "world"), [("single", 2), ("owner", 4), ("replicated", 4)])
def test_gradients_laid_out_unlike_their_parameters_are_stepped_as_the_parameters_shards(
    mode, world
):
    """DTensor's backward gives a layer with fewer rows (columns) than ranks a
    ``Replicate()`` gradient of its ``Shard(0)`` (``Shard(1)``) weight and bias: its local
    part is the whole gradient, not the shard. The step and ``clip_grad_norm_`` (owner
    mode: the reduction) lay it out as the parameter first (replicated mode counted the
    whole gradient on every tp rank in the norm), and the result equals one process, every
    step clipped. ``zero_grad(set_to_none=False)`` drops those gradients (torch cannot add
    the next backward's in place to them). In replicated mode the tp rank with the empty
    shards all-gathers only empty matrices over dp."""
    from dmuon.optim import clip_grad_norm_

    results = run_on_ranks(run_narrow_tp, world, args=(mode,), timeout=120)
    model = NarrowMLP()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = DMuon(param_groups(model), **OPT)
    norms = []
    for t in range(STEPS):
        x, y = narrow_batch(t)
        F.mse_loss(model(x), y).backward()
        norms.append(float(clip_grad_norm_(opt, NARROW_CLIP)))
        opt.step()
        opt.zero_grad()
    # what makes the case: torch's backward hands out Replicate() gradients here
    assert results[0][0][0]["fc1.weight"] == "(Replicate(),)", results[0][0]
    assert results[0][0][0]["fc1.bias"] == "(Replicate(),)", results[0][0]
    assert min(norms) > NARROW_CLIP, norms
    for rank, (_, got, got_norms) in enumerate(results):
        assert got_norms == pytest.approx(norms, rel=1e-5), (mode, rank, got_norms, norms)
        for name, want in model.named_parameters():
            assert (want.detach() - initial[name]).abs().max().item() > 1e-3
            diff = (got[name] - want.detach()).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"{mode}, rank {rank}: {name} differs by {diff:.2e}"


def run_heads_on_shards(rank, world, key):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # 8 rows over 2 ranks (4 + 4: each shard cut alike), and 1 row (1 + 0: an empty shard)
    params = [
        nn.Parameter(distribute_tensor(torch.ones(rows, 6), mesh, [Shard(0)])) for rows in (8, 1)
    ]
    return [
        error(lambda p=p: DMuon([{"params": [p], **key}], mode="single", **OPT)) for p in params
    ]


@pytest.mark.parametrize("key", [{"num_heads": 2}, {"split_sizes": (4, 4)}, {"num_heads": (2,)}])
def test_heads_and_split_sizes_of_a_tensor_parallel_matrix_are_refused_on_every_rank(key):
    """``num_heads`` / ``split_sizes`` would cut each rank's shard into matrices of its own
    (2 heads of 2 rows per shard, not 2 heads of 4 rows of the whole) whose Gram matrices
    the group then summed: silently wrong (0.9e-2 off one process after 3 steps). They are
    refused on every rank (a matrix with an empty shard too)."""
    results = run_on_ranks(run_heads_on_shards, 2, args=(key,), timeout=60)
    for rank, (cut, empty) in enumerate(results):
        assert cut is not None and "tensor-parallel shards do not hold whole" in cut, (rank, cut)
        assert empty is not None, rank  # refused (here by the whole shape's check) on every rank


def run_gram_batch(rank, world, count):
    """One ``single``-mode step of ``count`` same-shape colwise weights 16 × 8 (one batch of
    the Gram path), what the split's ``reduce`` counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(11)
    params = []
    for _ in range(count):
        w = nn.Parameter(distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Shard(0)]))
        local = torch.randn(16, 8, generator=g).chunk(world)[rank]
        w.grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        params.append(w)
    opt = DMuon(params, mode="single", tp_path="gram", **OPT)
    default_stats().reset()
    opt.step()
    return default_stats()[STATS_NAME]


@pytest.mark.parametrize("count", [1, 3])
def test_the_gram_path_sends_what_tensor_parallel_path_prices(count):
    """A batch of ``B`` weights 16 × 8 split by rows over 2 ranks (Gram side 8, the short
    one: one restart) all-reduces, in fp32: the ``B`` Gram matrices 8 × 8 twice, the
    ``B`` maxima, then the ``B`` squared norms and the split size. The bytes recorded on
    real ranks are that hand count, and what :func:`dmuon.comm.tensor_parallel_path`
    prices for the batch (it priced the normalisation at 8 bytes a collective whatever
    ``B``: 4 bytes too many for one matrix, 12 too few for three)."""
    from dmuon.comm import tensor_parallel_path

    b = count
    by_hand = 2 * b * 8 * 8 * 4 + b * 4 + (b + 1) * 4
    priced = tensor_parallel_path(16, 8, -2, 2, batch=b, element_size=4).gram_bytes
    for rank, got in enumerate(run_on_ranks(run_gram_batch, 2, args=(count,), timeout=120)):
        assert got.collectives == 4, (rank, got)  # 2 Gram matrices, a max, a sum: one batch
        assert got.payload_bytes == by_hand, (rank, got, by_hand)
        # over 2 ranks a ring all-reduce sends 2(t − 1)/t = 1 times its buffer
        assert got.bytes_sent == pytest.approx(priced, rel=1e-12), (rank, got, priced)
