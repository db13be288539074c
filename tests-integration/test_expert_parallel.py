"""Expert parallelism: expert stacks split over an ``ep`` mesh dimension, stepped where they live.

A small mixture-of-experts model holds its experts as stacks ``(E, m, n)`` (an
``nn.Parameter`` per stack, the group key ``flatten=False``: a batch of ``E``
matrices) beside dense matrices and scalars. Sharded over ``ep`` with the public
``distribute_tensor`` (``Shard(0)`` on ``ep``, ``Replicate()`` on ``dp``), each rank
holds whole experts, and ``single`` mode steps them there, as one batch, with no
gather — so a rule that needs whole matrices (Dion3's row selection) works too. Every
run below equals one process trained on the same global batches; the modes that do
not take them refuse the stacks on every rank, naming the parameter, its placements and
``single`` (owner mode's are in :mod:`test_owner_experts`). FSDP2's ``Shard(0)`` rows
of a stack are whole experts too, and a DCP checkpoint of the experts' state reshards
(dp 2 × ep 2 → ep 2, and one process).

The model and its expert-parallel dispatch are :mod:`expert_cases`'. Gradients arrive as
in a real EP run: an expert's is complete over its ``ep`` group, a dense matrix's is this
rank's part. The test's own all-reduces finish them (dense over every rank, experts over
``dp``), as DDP would.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expert_cases import (
    BATCH,
    OPT,
    RULES,
    STEPS,
    TOLERANCE,
    D,
    H,
    MoE,
    backward_on_rank,
    batch,
    clipped_reference,
    expert_parallel,
    moving_reference,
    reference,
    whole_params,
)
from tensor_parallel_cases import error
from torch import nn

from benchmarks.common.moe import finish_gradients
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups


def train(model: MoE, opt: DMuon, mesh, steps, clip: float | None = None) -> list[float]:
    """Each rank trains on its slice of every global batch; gradients finished as DDP
    would: summed over the ranks that hold the same tensor, divided by the world (the
    global loss is the mean of the ranks' means). With ``clip``, clipped by
    :func:`dmuon.optim.clip_grad_norm_`; returns the norms."""
    from dmuon.optim import clip_grad_norm_

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = BATCH // world
    norms: list[float] = []
    for t in steps:
        x, y = batch(t)
        mine = slice(rank * rows, (rank + 1) * rows)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        finish_gradients(model, mesh)
        if clip is not None:
            norms.append(clip_grad_norm_(opt, clip).item())
        opt.step()
        opt.zero_grad()
    return norms


def dmuon_for(model: MoE, mesh, mode: str, **options) -> DMuon:
    """DMuon in ``mode``; ``replicated`` plans owners over the mesh's ``dp`` group (the
    replicas of each rank's experts)."""
    group = {"process_group": mesh.get_group("dp")} if mode == "replicated" else {}
    return DMuon(param_groups(model), mode=mode, **group, **{**OPT, **options})


def run_rules(rank, world, shape, names, uneven, mode="single"):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out = {}
    cases = [(rule, 4) for rule in RULES] + ([("muon", 3)] if uneven else [])
    for rule, experts in cases:
        model = expert_parallel(mesh, experts)
        opt = dmuon_for(model, mesh, mode, rule=rule)
        local = tuple(model.w_in.to_local().shape)
        train(model, opt, mesh, range(STEPS))
        # replicated: the state lives on the stack's owner among its replicas alone (the
        # other replica keeps an empty placeholder under the same key)
        held = opt.state[model.w_in]["momentum_buffer"]
        state = tuple(held.shape) if held.numel() else None
        full = whole_params(model)
        out[(rule, experts)] = (full, local, state)
    return out


def check(results, cases) -> None:
    for rule, experts in cases:
        expected = moving_reference(rule, experts)
        for rank, out in enumerate(results):
            got, local, state = out[(rule, experts)]
            assert state in (local, None), f"{rule}, rank {rank}: state {state} not per expert"
            for name, want in expected.items():
                diff = (got[name] - want).abs().max().item()
                assert diff <= TOLERANCE, (
                    f"{rule}, E={experts}, rank {rank}: {name} off by {diff:.2e}"
                )


def test_ep2_steps_each_ranks_experts_like_one_process():
    """ep = 2 on 2 ranks, and 3 experts split 2 + 1 (DTensor's uneven ``Shard(0)``)."""
    results = run_on_ranks(run_rules, 2, args=((2,), ("ep",), True), timeout=180)
    assert [r[("muon", 4)][1][0] for r in results] == [2, 2]
    assert [r[("muon", 3)][1][0] for r in results] == [2, 1]
    check(results, [(rule, 4) for rule in RULES] + [("muon", 3)])


def test_ep4_one_expert_per_rank_like_one_process():
    """ep = 4 on 4 ranks, and 3 experts on 4 ranks: the last rank holds none."""
    results = run_on_ranks(run_rules, 4, args=((4,), ("ep",), True), timeout=240)
    assert [r[("muon", 4)][1][0] for r in results] == [1, 1, 1, 1]
    assert [r[("muon", 3)][1][0] for r in results] == [1, 1, 1, 0]
    check(results, [(rule, 4) for rule in RULES] + [("muon", 3)])


def test_ep2_by_dp2_like_one_process():
    """Experts split over ep and replicated over dp; the test all-reduces over dp."""
    results = run_on_ranks(run_rules, 4, args=((2, 2), ("dp", "ep"), False), timeout=240)
    assert [r[("muon", 4)][1][0] for r in results] == [2, 2, 2, 2]
    check(results, [(rule, 4) for rule in RULES])


@pytest.mark.parametrize("uneven", [False, True], ids=["4-experts", "3-experts"])
def test_replicated_owners_among_the_replicas_step_the_experts_like_one_process(uneven):
    """dp 2 × ep 2, ``mode="replicated"`` over ``dp``: each stack is stepped by one of the
    two replicas that hold its experts and all-gathered to the other; equal to one
    process for every rule (3 experts: split 2 + 1 over ep)."""
    results = run_on_ranks(
        run_rules, 4, args=((2, 2), ("dp", "ep"), uneven, "replicated"), timeout=300
    )
    cases = [("muon", 3)] if uneven else [(rule, 4) for rule in RULES]
    for rule, experts in cases:
        held = [r[(rule, experts)][2] is not None for r in results]
        # ranks 0, 1 hold experts of ep 0 and 1 at dp 0; ranks 2, 3 the same at dp 1:
        # each stack's state is on exactly one of its two replicas
        assert held[0] != held[2] and held[1] != held[3], (rule, held)
    check(results, cases)


STACK = "(Shard(dim=0),) on mesh dims ('ep',)"


def run_refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {}
    for mode in ("replicated", "sharded", None):
        out[mode] = error(
            lambda mode=mode: DMuon(param_groups(expert_parallel(mesh)), mode=mode, **OPT)
        )
    model = expert_parallel(mesh)
    out["sign"] = error(lambda: DMuon(param_groups(model), mode="sign", rule="sign_muon"))
    # a stack split along a matrix dimension is not an expert split
    from torch.distributed.tensor import Shard, distribute_tensor

    cut = MoE()
    cut.w_in = nn.Parameter(distribute_tensor(cut.w_in.detach(), mesh, [Shard(1)]))
    out["cut"] = error(lambda: DMuon(param_groups(cut), mode="single", **OPT))
    opt = DMuon([MoE().inp.weight], mode="single", **OPT)  # checked when added later too
    out["added"] = error(lambda: opt.add_param_group({"params": [cut.w_in], "flatten": False}))
    return out


def test_modes_without_expert_parallelism_refuse_it_on_every_rank():
    for rank, out in enumerate(run_on_ranks(run_refusals, 2, timeout=120)):
        for mode in ("replicated", "sign"):
            msg = out[mode]
            assert msg is not None, f"rank {rank}, {mode}: no error"
            assert "'w_in'" in msg and STACK in msg, (rank, mode, msg)
            assert f"mode={mode!r}" in msg and "mode='single' does" in msg, (rank, mode, msg)
            assert "whole experts" in msg, (rank, mode, msg)
        # replicated takes experts only with owners over replicas (dp) outside ep
        assert "split over ranks [0, 1]" in out["replicated"], (rank, out["replicated"])
        assert "plans owners over ranks [0, 1]" in out["replicated"], (rank, out["replicated"])
        for mode in ("sharded", None):  # None: detected as sharded (DTensor matrices)
            msg = out[mode]
            assert msg is not None, f"rank {rank}, {mode}: no error"
            assert "'inp.weight' is a plain tensor" in msg, (rank, mode, msg)
            assert "'w_in'" in msg and "mode='single'" in msg, (rank, mode, msg)
        msg = out["cut"]
        assert msg is not None, f"rank {rank}: a stack cut along a matrix dim was stepped"
        assert "'w_in'" in msg and "split along matrix dim 1" in msg, (rank, msg)
        msg = out["added"]
        assert msg is not None and "split along matrix dim 1" in msg, (rank, msg)


def run_save_and_continue(rank, world, path, rule, mode="single"):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import checkpoint

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    model = expert_parallel(mesh)
    opt = dmuon_for(model, mesh, mode, rule=rule)
    train(model, opt, mesh, range(2))
    checkpoint.save(path, model, opt)
    train(model, opt, mesh, range(2, 3))
    return whole_params(model)


def run_load_and_continue(rank, world, path, rule, mode="single"):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import checkpoint

    shape, names = ((world,), ("ep",)) if mode == "single" else ((2, world // 2), ("dp", "ep"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = expert_parallel(mesh)
    opt = dmuon_for(model, mesh, mode, rule=rule)
    checkpoint.load(path, model, opt)
    train(model, opt, mesh, range(2, 3))
    return whole_params(model)


@pytest.mark.parametrize("saved_by", ["single", "replicated"])
def test_dcp_checkpoint_of_expert_shards_resumes_on_another_mesh_and_in_one_process(
    tmp_path, saved_by
):
    """Saved on dp 2 × ep 2 (4 ranks; each expert's state on two replicas in ``single``
    mode, on one of them, its owner, in ``replicated``), resumed on ep 2 alone (2 ranks)
    and in one process: DCP reshards the stacks' state. ``replicated`` also resumes on its
    own mesh (before: its save failed in DCP's plan, the owner's local experts' state
    scattered over ``dp`` as if it were the whole stack's). normuon: momentum and
    per-expert, per-row state."""
    from dmuon.integrations import checkpoint

    rule = "normuon"
    path = str(tmp_path / "ep")
    args = (path, rule, saved_by)
    continued = run_on_ranks(run_save_and_continue, 4, args=args, timeout=240)
    resumed = run_on_ranks(run_load_and_continue, 2, args=(path, rule), timeout=180)
    if saved_by == "replicated":
        again = run_on_ranks(run_load_and_continue, 4, args=args, timeout=240)
        for rank, got in enumerate(again):
            for name, w in continued[rank].items():
                assert torch.equal(got[name], w), f"replicated rank {rank}: {name} differs"
    model = MoE()  # one process, whole stacks: DCP reassembles the experts' state
    opt = DMuon(param_groups(model), rule=rule, **OPT)
    checkpoint.load(path, model, opt)
    assert tuple(opt.state[model.w_in]["row_second_moment"].shape) == (4, H)
    x, y = batch(2)
    F.mse_loss(model(x), y).backward()
    opt.step()
    single = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = MoE()  # the weights only, with a fresh optimizer: what lost state looks like
    checkpoint.load(path, fresh, DMuon(param_groups(fresh), rule=rule, **OPT))
    forgetful = DMuon(param_groups(fresh), rule=rule, **OPT)
    F.mse_loss(fresh(x), y).backward()
    forgetful.step()
    want = continued[0]
    lost = max((fresh.state_dict()[n] - w).abs().max().item() for n, w in want.items())
    assert lost > 100 * TOLERANCE, "the optimizer state made no difference: void test"
    for what, got in [("rank 0", resumed[0]), ("rank 1", resumed[1]), ("one process", single)]:
        for name, w in want.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"resumed on {what}: {name} differs by {diff:.2e}"


def run_full_save(rank, world):
    """``replicated`` on dp 2 × ep 2: two steps, the whole state to rank 0
    (:func:`~dmuon.integrations.checkpoint.full_state_dict`), a third step."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations.checkpoint import full_state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = expert_parallel(mesh)
    opt = dmuon_for(model, mesh, "replicated", rule="normuon")
    train(model, opt, mesh, range(2))
    sd = full_state_dict(model, opt)
    train(model, opt, mesh, range(2, 3))
    return sd, {n: p.detach().full_tensor() for n, p in model.named_parameters() if n in STACKS}


def run_full_load(rank, world, sd):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations.checkpoint import load_full_state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = expert_parallel(mesh)
    opt = dmuon_for(model, mesh, "replicated", rule="normuon")
    load_full_state_dict(model, opt, sd)
    train(model, opt, mesh, range(2, 3))
    return {n: p.detach().full_tensor() for n, p in model.named_parameters() if n in STACKS}


STACKS = ("w_in", "w_out")


def test_full_state_of_replicated_experts_resumes_on_its_mesh_and_in_one_process():
    """The whole state on rank 0 holds every expert's state (each ``ep`` column's owner's
    share, not rank 0's column twice); loaded on the same mesh the third step equals
    continuing, bitwise, and in one process the stacks' state is whole."""
    from dmuon.integrations.checkpoint import load_full_state_dict

    saved = run_on_ranks(run_full_save, 4, timeout=240)
    sd, continued = saved[0]
    assert tuple(sd["optim"]["state"]["w_in"]["momentum_buffer"].shape) == (4, H, D)
    for rank, got in enumerate(run_on_ranks(run_full_load, 4, args=(sd,), timeout=240)):
        for n in STACKS:
            assert torch.equal(got[n], continued[n]), f"rank {rank}: {n} differs"
    model = MoE()
    opt = DMuon(param_groups(model), rule="normuon", **OPT)
    load_full_state_dict(model, opt, sd)
    x, y = batch(2)
    F.mse_loss(model(x), y).backward()
    opt.step()
    for n in STACKS:
        diff = (getattr(model, n).detach() - continued[n]).abs().max().item()
        assert diff <= TOLERANCE, f"one process: {n} off by {diff:.2e}"


CLIP = 0.5  # below the gradient norm of every step (≈ 1.5–3): clipping acts


def run_clipped(rank, world, mode="single"):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    model = expert_parallel(mesh)
    opt = dmuon_for(model, mesh, mode, rule="muon")
    norms = train(model, opt, mesh, range(STEPS), clip=CLIP)
    full = whole_params(model)
    return norms, full


@pytest.mark.parametrize("mode", ["single", "replicated"])
def test_clip_grad_norm_counts_every_expert_once_on_dp2_by_ep2(mode):
    """The global norm over experts split on ep and replicated on dp, and dense matrices
    on every rank, equals torch's ``clip_grad_norm_`` in one process, and the clipped
    run equals the clipped one process (a wrong norm changes each step's scale, and
    momentum mixes steps of different scales)."""
    expected, want_norms = clipped_reference("muon", CLIP)
    for rank, (norms, got) in enumerate(run_on_ranks(run_clipped, 4, args=(mode,), timeout=240)):
        assert norms == pytest.approx(want_norms, rel=1e-5), (rank, norms, want_norms)
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_fsdp2_stacks(rank, world, rule, mode="single", experts=4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = MoE(experts)
    fully_shard(model, mesh=mesh)
    opt = DMuon(param_groups(model), mode=mode, rule=rule, **OPT)
    local = tuple(model.w_in.to_local().shape)
    if mode == "sharded":  # the owners the engine planned, for the check below
        plan = opt.engine.plan
        local = (local, dict(zip(plan.names, plan.owners, strict=True)), plan.items, plan.loads)
    rows = BATCH // world
    for t in range(STEPS):
        x, y = batch(t)
        mine = slice(rank * rows, (rank + 1) * rows)
        F.mse_loss(model(x[mine]), y[mine]).backward()  # FSDP2 averages over the ranks
        opt.step()
        opt.zero_grad()
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}, local


@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_fsdp2_rows_of_a_stack_are_whole_experts_stepped_in_single_mode(rule):
    """FSDP2's ``Shard(0)`` of an expert stack is an expert split too: ``single`` mode steps
    each rank's experts where they are (and the 2-D matrices' rows with the
    tensor-parallel Gram path); before, it refused them."""
    expected = reference(rule)
    results = run_on_ranks(run_fsdp2_stacks, 2, args=(rule,), timeout=120)
    for rank, (got, local) in enumerate(results):
        assert local == (2, H, D), local
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"{rule}, rank {rank}: {name} differs by {diff:.2e}"


def test_fsdp2_stacks_in_sharded_mode_stay_where_they_are_and_weigh_in_the_plan():
    """``sharded`` mode steps FSDP2's rows of a stack (whole experts) on their ranks; 3
    experts on 2 ranks are held 2 + 1, and the dense matrices' owners are planned around
    that load: the plan equals ``plan_owners(..., held=...)`` with the experts each rank
    holds (computed here from ``torch.chunk``), whose loads count them. Equal to one
    process."""
    from dmuon.comm import MatrixItem, layer_key, plan_owners

    expected = reference("muon", experts=3)
    results = run_on_ranks(run_fsdp2_stacks, 2, args=("muon", "sharded", 3), timeout=120)
    stacks = [("w_in", (H, D)), ("w_out", (D, H))]
    held = [  # torch.chunk(3 experts, 2) = 2 + 1
        [MatrixItem(f"{n}[rank {r}]", (k, *shape), layer=layer_key(n)) for n, shape in stacks]
        for r, k in enumerate([2, 1])
    ]
    for rank, (got, (local, owners, items, loads)) in enumerate(results):
        assert local == ((2, H, D), (1, H, D))[rank], local
        assert "w_in" not in owners and "w_out" not in owners, owners  # not planned
        want = plan_owners(items, 2, held=held)
        ignoring = plan_owners(items, 2)
        assert owners == dict(zip(want.names, want.owners, strict=True)), (owners, held)
        # the loads the plan balanced count each rank's experts (rank 0 holds more)
        assert loads == pytest.approx(want.loads), (loads, want.loads)
        assert want.loads[0] - ignoring.loads[0] > want.loads[1] - ignoring.loads[1] > 0
        for name, w in expected.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_nonfinite(rank, world, policy):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.optim.engine import NonFiniteGradientError

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = expert_parallel(mesh)
    opt = DMuon(param_groups(model), mode="single", nonfinite=policy, **OPT)
    local = {n: p for n, p in model.named_parameters()}
    before = {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for n, p in local.items()
    }
    backward_on_rank(model, 0)
    if rank == 0:  # one expert of rank 0 only: rank 1's gradients are all finite
        model.w_in.grad.to_local()[0, 0, 0] = float("nan")
    try:
        opt.step()
        outcome = "stepped"
    except NonFiniteGradientError as err:
        outcome = f"raised: {err}"
    moved = [
        n
        for n, p in local.items()
        if not torch.equal((p.to_local() if hasattr(p, "to_local") else p).detach(), before[n])
    ]
    return outcome, moved, opt.skipped_steps


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_nonfinite_expert_gradient_on_one_rank_stops_every_rank(policy):
    """Experts differ between ranks, so a NaN in one rank's expert is seen by that rank
    alone; single mode agrees over the world (one small all-reduce per step, only with
    DTensor matrices on several ranks), so no rank steps while another does not."""
    for rank, (outcome, moved, skipped) in enumerate(
        run_on_ranks(run_nonfinite, 2, args=(policy,), timeout=120)
    ):
        assert moved == [], (rank, policy, moved)
        if policy == "raise":
            assert outcome.startswith("raised") and "rank" in outcome, (rank, outcome)
        else:
            assert outcome == "stepped" and skipped == 1, (rank, outcome, skipped)
