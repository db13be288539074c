"""Owner mode with expert parallelism: ``ddp.dedicate`` over the ranks an expert stack is
split over steps each rank's experts where they live, the dense matrices by their owners.

The model is :mod:`expert_cases`' soft-routed MoE, its two expert stacks ``Shard(0)`` on a
1-D ``ep`` mesh over every rank. ``ddp.dedicate`` dedicates the dense matrices (planned
around each rank's experts: ``plan_owners(held=...)``), all-reduces the scalars, and leaves
the stacks out: each rank's experts are whole, their gradients complete once the
dispatch's backward has run (every rank's loss summed into them), and a hook divides them
by the world as the dense ones are averaged. The training loop is DDP's — forward,
backward, ``opt.step()`` — with no gradient code of its own, and every run equals one
process trained on the same global batches. Experts replicated over ``dp`` (a ``dp × ep``
mesh) are taken too: each stack has one owner among the ``dp`` replicas of its experts,
which the gradient is reduced to and which broadcasts the stepped experts back. Experts
laid out beyond the dedication's ranks, and under ``fsdp.dedicate``, are refused on every
rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expert_cases import (
    OPT,
    RULES,
    STEPS,
    TOLERANCE,
    MoE,
    backward_on_rank,
    batch,
    clipped_reference,
    expert_parallel,
    moving_reference,
    rank_batch,
    whole_params,
)
from tensor_parallel_cases import error
from torch import nn

from benchmarks.common.moe import split_experts
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, NonFiniteGradientError, param_groups

STACKS = ("w_in", "w_out")
DP_EP = ((2, 2), ("dp", "ep"))  # 4 ranks: each rank's experts also on its dp replica
MESHES = pytest.mark.parametrize(
    ("world", "mesh"), [(2, ((2,), ("ep",))), (4, DP_EP)], ids=["ep2", "dp2xep2"]
)


def train(model: MoE, opt: DMuon, steps) -> None:
    """Each rank trains on its slice of every global batch; no gradient code: the
    dedication finishes every gradient."""
    for t in steps:
        backward_on_rank(model, t)
        opt.step()
        opt.zero_grad()


def run_owner(rank, world, cases, scalars, shape=None, names=("ep",), pack_bytes=None):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp
    from dmuon.optim.engine import expert_replicas

    if pack_bytes is not None:  # this rank process's own module: the others' are theirs
        expert_replicas.PACK_BYTES = pack_bytes
    mesh = init_device_mesh("cpu", shape or (world,), mesh_dim_names=names)
    out = {}
    for rule, experts in cases:
        model = expert_parallel(mesh, experts)
        ded = ddp.dedicate(model, scalars=scalars)
        opt = DMuon(param_groups(model), distributed=ded, rule=rule, **OPT)
        train(model, opt, range(STEPS))
        ded.wait()
        state = {n: tuple(opt.state[getattr(model, n)]["momentum_buffer"].shape) for n in STACKS}
        moved = ded.exchange.stats["expert_replicas"].payload_bytes
        sends = [(len(m), packed) for s in opt.engine._replicas.sets for _, m, packed in s.sends]
        full = whole_params(model)
        plan = ded.plan
        out[(rule, experts)] = {
            "params": full,
            "local": tuple(model.w_in.to_local().shape),
            "local_shapes": {n: tuple(getattr(model, n).to_local().shape) for n in STACKS},
            "state": state,
            "experts": ded.experts,
            "repr": repr(ded),
            "names": ded.names,
            "owned": ded.owned,
            "loads": list(plan.loads),
            "moved": moved,
            "sends": sends,
        }
    return out


def check(results, cases, replicas: int = 1) -> None:
    """Every rank equals one process; each stack's state is its local experts' on exactly
    one of the ranks holding them (its owner among the ``replicas``), and the experts
    move over ``dp`` only when they have replicas."""
    for rule, experts in cases:
        expected = moving_reference(rule, experts)
        for rank, out in enumerate(results):
            got = out[(rule, experts)]
            assert got["experts"] == STACKS, (rank, got["experts"])
            assert "2 expert stacks in place" in got["repr"], got["repr"]
            assert not set(STACKS) & set(got["names"]), got["names"]  # not dedicated
            assert (got["moved"] > 0) == (replicas > 1), (rank, got["moved"])
            for name, want in expected.items():
                diff = (got["params"][name] - want).abs().max().item()
                assert diff <= TOLERANCE, (
                    f"{rule}, E={experts}, rank {rank}: {name} off by {diff:.2e}"
                )
        # ranks r and r + world/replicas hold the same experts (dp is the outer dimension)
        columns = len(results) // replicas
        for column in range(columns):
            same = [results[column + k * columns][(rule, experts)] for k in range(replicas)]
            for n in STACKS:
                held = [got["state"][n] == got["local_shapes"][n] for got in same]
                assert sum(held) == 1, (rule, experts, column, n, [g["state"][n] for g in same])


def test_owner_mode_steps_each_ranks_experts_where_they_live_like_one_process():
    """ep = 2 on 2 ranks, muon / normuon / dion3 with 4 experts and muon with 3 (2 + 1);
    the scalars all-reduced (DDP's way) and, for muon, owned too."""
    cases = [(rule, 4) for rule in RULES] + [("muon", 3)]
    results = run_on_ranks(run_owner, 2, args=(cases, "all_reduce"), timeout=240)
    assert [r[("muon", 4)]["local"][0] for r in results] == [2, 2]
    assert [r[("muon", 3)]["local"][0] for r in results] == [2, 1]
    check(results, cases)
    owned = run_on_ranks(run_owner, 2, args=([("muon", 4)], "owner"), timeout=180)
    check(owned, [("muon", 4)])


def test_owner_mode_with_one_expert_per_rank_and_a_rank_without_any():
    """ep = 4 on 4 ranks, 3 experts: the last rank holds none and plans more dense matrices."""
    results = run_on_ranks(run_owner, 4, args=([("muon", 3)], "all_reduce"), timeout=240)
    assert [r[("muon", 3)]["local"][0] for r in results] == [1, 1, 1, 0]
    check(results, [("muon", 3)])


CLIP = 0.05  # below every step's gradient norm here (2.99, 2.25, 1.86): clipping binds


def run_accumulated(rank, world, shape, names):
    """Each global batch as two micro-batches per rank, the first under ``ded.no_sync()``,
    with the dense weights freed after each forward (``reshard_after_forward=True``), and
    the gradients clipped by their global norm before each step."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp
    from dmuon.optim import clip_grad_norm_

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = expert_parallel(mesh)
    ded = ddp.dedicate(model, reshard_after_forward=True)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    norms = []
    for t in range(STEPS):
        xs, ys = rank_batch(t)
        half = len(xs) // 2
        with ded.no_sync():
            (F.mse_loss(model(xs[:half]), ys[:half]) / 2).backward()
        (F.mse_loss(model(xs[half:]), ys[half:]) / 2).backward()
        norms.append(clip_grad_norm_(opt, CLIP).item())
        opt.step()
        opt.zero_grad()
    ded.wait()  # the owners' last publications, every rank's weights whole until a forward
    return whole_params(model), norms


@MESHES
def test_accumulated_micro_batches_with_freed_weights_and_clipping_step_like_one_process(
    world, mesh
):
    """On dp 2 × ep 2 the first micro-batch launches no expert reduction, the second
    launches them in backward, and ``clip_grad_norm_`` waits for them: the norms and the
    parameters equal one process clipping with torch's ``clip_grad_norm_``."""
    expected, want = clipped_reference("muon", CLIP)
    results = run_on_ranks(run_accumulated, world, args=mesh, timeout=180)
    for rank, (got, norms) in enumerate(results):
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms, want, strict=True)), (norms, want)
        for name, w in expected.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e}"


def run_grads(rank, world, shape=None, names=("ep",)):
    """The experts' gradients and the gradient norm after one backward, before any step,
    with the dedication's hooks taken off and put back (``install_hooks``, as after
    swapping modules): the experts' division by the world comes back with them."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp, install_hooks
    from dmuon.optim import clip_grad_norm_

    mesh = init_device_mesh("cpu", shape or (world,), mesh_dim_names=names)
    model = expert_parallel(mesh)
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    ded.remove()
    ded.handles = install_hooks(model, ded.exchange)
    backward_on_rank(model, 0)
    norm = clip_grad_norm_(opt, float("inf")).item()  # makes every gradient final first
    experts = model.local_experts.tolist()  # the experts this rank holds
    grads = {  # final on the stack's owner among its replicas (on ep alone: every rank)
        n: getattr(model, n).grad.to_local().clone()
        for n in STACKS
        if opt.engine.steps(getattr(model, n))
    }
    return experts, grads, norm


@MESHES
def test_expert_gradients_are_those_of_the_mean_loss_and_the_norm_counts_each_once(world, mesh):
    """The rules are scale-invariant, so the steps alone would not see a gradient off by the
    world: the experts' gradients (summed over their ``dp`` replicas on dp 2 × ep 2) and
    ``clip_grad_norm_`` (each expert counted once) equal one process's."""
    model = MoE()
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    want = {n: getattr(model, n).grad for n in STACKS}
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    checked = {n: set() for n in STACKS}
    results = run_on_ranks(run_grads, world, args=mesh, timeout=180)
    for rank, (experts, grads, got) in enumerate(results):
        for n, g in grads.items():
            diff = (g - want[n][experts]).abs().max().item()
            assert diff <= 1e-6 * want[n].abs().max().item(), (rank, n, diff)
            checked[n] |= set(experts)
        assert abs(got - norm) <= 1e-6 * norm, (rank, got, norm)
    assert all(v == {0, 1, 2, 3} for v in checked.values()), checked  # every expert seen


def test_dp2_by_ep2_one_owner_among_the_replicas_steps_each_stack_like_one_process():
    """dp 2 × ep 2 on 4 ranks: each rank's experts are held by one other rank too (its
    ``dp`` replica); each stack's gradient is reduced to one of the two, which steps it
    and broadcasts it back."""
    cases = [(rule, 4) for rule in RULES] + [("muon", 3)]
    results = run_on_ranks(run_owner, 4, args=(cases, "all_reduce", *DP_EP), timeout=300)
    assert [r[("muon", 4)]["local"][0] for r in results] == [2, 2, 2, 2]
    assert [r[("muon", 3)]["local"][0] for r in results] == [2, 1, 2, 1]
    assert all(packed for r in results for _, packed in r[("muon", 4)]["sends"])  # tiny stacks
    check(results, cases, replicas=2)


def test_large_stacks_are_broadcast_back_in_place_like_one_process():
    """dp 2 × ep 2 with every stack "large" (``PACK_BYTES = 0``): each stack is broadcast
    from its owner's experts into its replica's, one ``broadcast`` a stack (no flat copy),
    and training equals one process (the default run above packs these tiny stacks)."""
    cases = [("muon", 4)]
    results = run_on_ranks(run_owner, 4, args=(cases, "all_reduce", *DP_EP, 0), timeout=180)
    check(results, cases, replicas=2)
    for rank, got in enumerate(results):
        assert got[cases[0]]["sends"] == [(1, False)] * len(STACKS), (rank, got[cases[0]])


def run_missing_gradient(rank, world):
    """dp 2 × ep 2; rank 2's backward gives ``w_out`` no gradient (an expert stack no token
    of its reached; here: frozen for that backward, so its hook never fires): the reduction
    to the stack's owner among the replicas takes it as zeros, launched by rank 2 at the
    step in the order the others launched theirs in backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp
    from dmuon.optim import clip_grad_norm_

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model = expert_parallel(mesh)
    opt = DMuon(param_groups(model), distributed=ddp.dedicate(model), **OPT)
    model.w_out.requires_grad_(rank != 2)
    backward_on_rank(model, 0)
    model.w_out.requires_grad_(True)
    g = model.w_out.grad
    before = g.to_local().clone() if g is not None else torch.zeros_like(model.w_out.to_local())
    clip_grad_norm_(opt, float("inf"))
    owns = opt.engine.steps(model.w_out)
    return before, model.w_out.grad.to_local().clone() if owns else None


def test_an_expert_without_a_gradient_on_one_replica_counts_as_zeros():
    results = run_on_ranks(run_missing_gradient, 4, timeout=120)
    for pair, want in (((0, 2), results[0][0]), ((1, 3), results[1][0] + results[3][0])):
        owners = [r for r in pair if results[r][1] is not None]
        assert len(owners) == 1, (pair, owners)  # one owner among the two replicas
        got = results[owners[0]][1]
        assert torch.allclose(got, want, rtol=0, atol=1e-7), (pair, (got - want).abs().max())


def run_overlap(rank, world, used):
    """dp 2 × ep 2, two optimizers built over one dedication, one of them (``used``)
    trained: the experts' reductions to their owners are launched in backward, before the
    first layer's gradients arrive, once each (the optimizers share them); none inside
    ``no_sync()``. Three steps, the first two accumulated over two micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model = expert_parallel(mesh)
    ded = ddp.dedicate(model)
    opts = [DMuon(param_groups(model), distributed=ded, **OPT) for _ in range(2)]
    opt = opts[used]
    stats = ded.exchange.stats
    seen = []  # the experts' collectives so far, when the first layer's gradient arrives
    model.inp.weight.register_post_accumulate_grad_hook(
        lambda _: seen.append(stats["expert_replicas"].collectives)
    )
    for t in range(STEPS):
        xs, ys = rank_batch(t)
        half = len(xs) // 2
        if t < 2:
            with ded.no_sync():
                (F.mse_loss(model(xs[:half]), ys[:half]) / 2).backward()
            (F.mse_loss(model(xs[half:]), ys[half:]) / 2).backward()
        else:
            F.mse_loss(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    reduces = sum(len(s.buckets) for s in opt.engine._replicas.sets)
    broadcasts = sum(len(s.sends) for s in opt.engine._replicas.sets)
    return seen, reduces, broadcasts, whole_params(model)


@pytest.mark.parametrize("used", [0, 1], ids=["first", "second"])
def test_the_experts_reductions_overlap_backward(used):
    expected = moving_reference("muon")
    for rank, (seen, reduces, broadcasts, got) in enumerate(
        run_on_ranks(run_overlap, 4, args=(used,), timeout=120)
    ):
        assert reduces > 0, rank
        per_step = reduces + broadcasts
        # step t's reductions are all under way when its last backward reaches the first
        # layer; nothing is launched in a no_sync backward
        want = [0, reduces, per_step, per_step + reduces, 2 * per_step + reduces]
        assert seen == want, (rank, seen, want)
        for name, w in expected.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e}"


def run_changed(rank, world):
    """dp 2 × ep 2: rank 1 scales an expert gradient after backward had sent it; every rank
    refuses the step and nothing moves. The dropped iteration's gradients are spent; the
    next steps train on."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp
    from dmuon.optim import GradientChangedError

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model = expert_parallel(mesh)
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    backward_on_rank(model, 0)
    if rank == 1:
        model.w_in.grad.mul_(0.5)
    before = {n: getattr(model, n).detach().to_local().clone() for n in STACKS}
    try:
        opt.step()
        err = None
    except GradientChangedError as e:
        err = str(e)
    same = all(torch.equal(before[n], getattr(model, n).to_local()) for n in STACKS)
    opt.zero_grad()
    train(model, opt, range(STEPS))
    ded.wait()
    full = whole_params(model)
    return err, same, full


def test_an_expert_gradient_changed_after_backward_is_refused_on_every_rank():
    expected = moving_reference("muon")
    for rank, (err, same, full) in enumerate(run_on_ranks(run_changed, 4, timeout=180)):
        assert err is not None and "rank(s) [1]" in err, (rank, err)
        assert rank != 1 or "'w_in'" in err, err
        assert same, f"rank {rank}: experts stepped although a gradient was changed"
        for name, want in expected.items():
            diff = (full[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e} after the refusal"


def run_dropped(rank, world):
    """dp 2 × ep 2: a backward dropped by ``opt.zero_grad()`` (no step) finishes its
    experts' reductions on every rank — rank 3's backward reached no expert stack, so it
    launches them there — and training goes on as if it had not run."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model = expert_parallel(mesh)
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    for n in STACKS:
        getattr(model, n).requires_grad_(rank != 3)
    backward_on_rank(model, 99)
    for n in STACKS:
        getattr(model, n).requires_grad_(True)
    opt.zero_grad()  # drop the batch
    train(model, opt, range(STEPS))
    ded.wait()
    return whole_params(model)


def test_a_dropped_backward_finishes_the_experts_reductions_and_is_forgotten():
    expected = moving_reference("muon")
    for rank, full in enumerate(run_on_ranks(run_dropped, 4, timeout=180)):
        for name, want in expected.items():
            diff = (full[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e}"


def run_unused_everywhere(rank, world, shape, names):
    """In step 0 no rank's backward reaches ``w_out`` (frozen for it), then two ordinary
    steps."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    model = expert_parallel(init_device_mesh("cpu", shape, mesh_dim_names=names))
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    model.w_out.requires_grad_(False)
    train(model, opt, range(1))
    model.w_out.requires_grad_(True)
    train(model, opt, range(1, STEPS))
    ded.wait()
    return whole_params(model)


@MESHES
def test_a_stack_without_a_gradient_on_every_replica_is_not_stepped(world, mesh):
    """One process skips a parameter without a gradient (no momentum, no weight decay);
    so does each rank on ep 2, and on dp 2 × ep 2 the stack's owner when no replica had a
    gradient for it (each replica's presence summed in the reduction), instead of
    stepping it with a zero gradient."""
    model = MoE()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        model.w_out.requires_grad_(t != 0)
        x, y = batch(t)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank, got in enumerate(run_on_ranks(run_unused_everywhere, world, args=mesh, timeout=120)):
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e}"


def run_plan(rank, world):
    """The dense plan with the experts held, against ``plan_owners`` given the same
    experts by hand."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.comm import MatrixItem, layer_key, plan_owners
    from dmuon.integrations import ddp
    from dmuon.integrations.selection import split_parameters

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = expert_parallel(mesh, 3)
    ded = ddp.dedicate(model)
    dense = [i for i, _ in split_parameters(MoE(3))[0] if i.name not in STACKS]
    stacks = {n: tuple(getattr(MoE(3), n).shape[1:]) for n in STACKS}
    held = [  # torch.chunk(3 experts, 2) = 2 + 1
        [MatrixItem(f"{n}[rank {r}]", (k, *s), layer=layer_key(n)) for n, s in stacks.items()]
        for r, k in enumerate((2, 1))
    ]
    want = plan_owners(dense, world, held=held)
    return ded.plan.owners, want.owners, ded.plan.loads, want.loads


def test_the_dense_plan_starts_each_ranks_load_with_its_experts():
    for got, want, loads, want_loads in run_on_ranks(run_plan, 2, timeout=120):
        assert got == want and loads == want_loads, (got, want, loads, want_loads)
        assert loads[0] != loads[1]  # 2 experts against 1: the experts are counted


def run_held(rank, world):
    """dp 2 × ep 2: the experts ``ddp.dedicate`` counts as each rank's load (``held``)
    against those the optimizer's engine steps there."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp
    from dmuon.integrations.dedication import held_experts, in_place_experts
    from dmuon.integrations.selection import split_parameters

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model = expert_parallel(mesh)
    opt = DMuon(param_groups(model), distributed=ddp.dedicate(model), **OPT)
    held = held_experts(in_place_experts(split_parameters(model)[0], None), None)
    planned = {i.name.split("[")[0] for i in held[rank]}
    stepped = {n for n in STACKS if opt.engine.steps(getattr(model, n))}
    return planned, stepped


def test_the_plan_counts_each_replicas_own_experts_as_the_engine_steps_them():
    results = run_on_ranks(run_held, 4, timeout=120)
    for rank, (planned, stepped) in enumerate(results):
        assert planned == stepped, (rank, planned, stepped)
    for a, b in ((0, 2), (1, 3)):  # replicas of each other: every stack on exactly one
        assert results[a][1] | results[b][1] == set(STACKS), (a, b)
        assert not results[a][1] & results[b][1], (a, b)


def run_fsdp(rank, world, rule, shape, names, free=False):
    """``fsdp.dedicate`` over a 1-D mesh of every rank, then ``fully_shard`` of the rest
    (the scalars) with ``ignored_params=ded.params``: the dedicated matrices and the expert
    stacks, which stay where they live. With ``free`` (``free_local_grads``), also the
    stacks whose local gradient is still held after each backward (none should be)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp

    experts_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = expert_parallel(experts_mesh)
    ded = fsdp.dedicate(model, dp, free_local_grads=free)
    ignored = ded.params
    assert {n for n, p in model.named_parameters() if p in ignored} >= set(STACKS)
    fully_shard(model, mesh=dp, ignored_params=ignored)
    opt = DMuon(param_groups(model), distributed=ded, rule=rule, **OPT)
    held, owned = [], []
    for t in range(STEPS):
        backward_on_rank(model, t)
        held += [(t, n) for n in STACKS if getattr(model, n).grad is not None]
        opt.step()  # the owners' gradients are the sums from here on
        owned += [(t, n) for n in STACKS if getattr(model, n).grad is not None]
        opt.zero_grad()
    ded.wait()
    owns = [n for n in STACKS if opt.engine.steps(getattr(model, n))]
    return whole_params(model), held, owned, owns


@MESHES
@pytest.mark.parametrize("free", [False, True], ids=["kept", "free_local_grads"])
def test_fsdp_dedicate_leaves_the_experts_where_they_live_and_steps_like_one_process(
    world, mesh, free
):
    """The scalars sharded by FSDP2, the dense matrices dedicated, the experts in place
    (on dp 2 × ep 2 one owner among each stack's replicas): equal to one process. Under
    ``free_local_grads`` no rank holds a stack's local gradient after backward (its bucket
    does), and each stack's owner holds the summed one in the step (on ``ep`` alone a
    rank's experts have no replicas: their gradients are final, and kept)."""
    expected = moving_reference("normuon")
    args = ("normuon", *mesh, free)
    for rank, (got, held, owned, owns) in enumerate(
        run_on_ranks(run_fsdp, world, args=args, timeout=240)
    ):
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e}"
        everywhere = [(t, n) for t in range(STEPS) for n in STACKS]
        assert held == ([] if free and world == 4 else everywhere), (rank, held)
        # an owner's stack holds the sum after the step; a replica that does not own it
        # keeps its own gradient, unless freed
        want_owned = [(t, n) for t, n in everywhere if n in owns or not free]
        assert owned == want_owned, (rank, owned, owns)


def run_summed_grads(rank, world, shape, names):
    """``fsdp.dedicate(..., reduce_op="sum")`` (torchtitan's setup, beside FSDP2 with
    ``set_gradient_divide_factor(1.0)``, which gloo cannot run: FSDP2 averages the scalars
    here): the matrices' gradients, the experts' included, are the sum of the ranks';
    after one backward, made final by ``clip_grad_norm_``, before any step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp
    from dmuon.optim import clip_grad_norm_

    experts_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = expert_parallel(experts_mesh)
    ded = fsdp.dedicate(model, dp, reduce_op="sum")
    fully_shard(model, mesh=dp, ignored_params=ded.params)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    backward_on_rank(model, 0)
    clip_grad_norm_(opt, float("inf"))
    grads = {
        n: getattr(model, n).grad.to_local().clone()
        for n in STACKS
        if opt.engine.steps(getattr(model, n))
    }
    if opt.engine.steps(model.inp.weight):  # a dense matrix, on its owner
        grads["inp.weight"] = model.inp.weight.grad.clone()
    return model.local_experts.tolist(), grads


@MESHES
def test_summed_gradients_sum_the_experts_too(world, mesh):
    """With ``reduce_op="sum"`` each rank's mean loss counts whole: a matrix's gradient is
    ``world`` × one process's (the experts' as the dispatch sums them over ``ep``, and on
    dp 2 × ep 2 over their replicas): no expert is divided by the world."""
    model = MoE()
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    want = {n: world * p.grad for n, p in model.named_parameters()}
    checked = {n: set() for n in STACKS}
    dense = 0
    results = run_on_ranks(run_summed_grads, world, args=mesh, timeout=180)
    for rank, (experts, grads) in enumerate(results):
        for n, g in grads.items():
            ref = want[n] if n == "inp.weight" else want[n][experts]
            diff = (g - ref).abs().max().item()
            assert diff <= 1e-6 * ref.abs().max().item(), (rank, n, diff)
            if n in checked:
                checked[n] |= set(experts)
            else:
                dense += 1
    assert all(v == {0, 1, 2, 3} for v in checked.values()), checked  # every expert seen
    assert dense == 1, dense  # one owner of the dense matrix


def run_refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    alone = [dist.new_group([r]) for r in range(world)][rank]  # a dedication of one rank
    return {"other ranks": error(lambda: ddp.dedicate(expert_parallel(mesh), group=alone))}


def test_experts_laid_out_beyond_the_dedication_are_refused_on_every_rank():
    """A dedication over one rank of the two the experts span."""
    for rank, out in enumerate(run_on_ranks(run_refusals, 2, timeout=120)):
        msg = out["other ranks"]
        assert msg is not None, f"rank {rank}: no error"
        assert "'w_in'" in msg and "mode='replicated'" in msg, (rank, msg)
        assert "spans the dedication's ranks exactly" in msg, (rank, msg)


def run_two_replica_dims(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "dp2", "ep"))
    model = expert_parallel(mesh)
    ded = ddp.dedicate(model)
    return error(lambda: DMuon(param_groups(model), distributed=ded, **OPT))


def test_experts_replicated_over_two_mesh_dimensions_are_refused_on_every_rank():
    """8 ranks, ``dp × dp2 × ep``: each stack has replicas over two dimensions, where owner
    mode plans one owner among the replicas of one."""
    for rank, msg in enumerate(run_on_ranks(run_two_replica_dims, 8, timeout=180)):
        assert msg is not None, f"rank {rank}: no error"
        assert "'w_in'" in msg or "'w_out'" in msg, (rank, msg)
        assert "replicated over 2 mesh dimensions" in msg, (rank, msg)
        assert "flatten them into one dimension" in msg, (rank, msg)


def run_nonfinite(rank, world, policy):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = expert_parallel(mesh)
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, nonfinite=policy, **OPT)
    train(model, opt, range(1))
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters() if n in STACKS}
    backward_on_rank(model, 1)
    if rank == 1:
        model.w_out.grad.to_local()[0, 0, 0] = float("nan")  # one expert of rank 1 only
    try:
        opt.step()
        err = None
    except NonFiniteGradientError as e:
        err = str(e)
    ded.wait()
    after = {n: getattr(model, n).detach().to_local() for n in STACKS}
    same = all(torch.equal(before[n], after[n]) for n in STACKS)
    return err, same


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_nonfinite_expert_gradient_on_one_rank_stops_every_rank(policy):
    for rank, (err, same) in enumerate(run_on_ranks(run_nonfinite, 2, args=(policy,), timeout=120)):
        if policy == "raise":
            assert err is not None and "on rank(s) [1]" in err, (rank, err)
            assert rank == 0 or "['w_out']" in err, (rank, err)  # named where it is
        else:
            assert err is None, (rank, err)
        assert same, f"rank {rank}: experts stepped although a rank saw a NaN"


def run_resume(rank, world, path, rule, shape=None, names=("ep",)):
    """Train 2 steps, save (DCP), train a third; a fresh dedication loads and trains the
    third too."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import checkpoint, ddp

    mesh = init_device_mesh("cpu", shape or (world,), mesh_dim_names=names)

    def build():
        model = expert_parallel(mesh)
        ded = ddp.dedicate(model)
        return model, ded, DMuon(param_groups(model), distributed=ded, rule=rule, **OPT)

    params = whole_params
    model, ded, opt = build()
    train(model, opt, range(2))
    checkpoint.save(path, model, opt)
    train(model, opt, range(2, 3))
    ded.wait()
    continued = params(model)
    model, ded, opt = build()
    checkpoint.load(path, model, opt)
    state = tuple(opt.state[model.w_in]["momentum_buffer"].shape)
    local = tuple(model.w_in.to_local().shape) if opt.engine.steps(model.w_in) else (0,)
    train(model, opt, range(2, 3))
    ded.wait()
    return continued, params(model), state, local


@MESHES
def test_a_dcp_checkpoint_resumes_the_experts_state_where_it_lives(tmp_path, world, mesh):
    """normuon: momentum and per-expert, per-row state, loaded where it lives: on ep 2 on
    every rank, on dp 2 × ep 2 on each stack's owner among its replicas (a placeholder on
    the other)."""
    path = str(tmp_path / "ckpt")
    results = run_on_ranks(run_resume, world, args=(path, "normuon", *mesh), timeout=180)
    for rank, (continued, resumed, state, local) in enumerate(results):
        assert state == local, (rank, state, local)
        for name, want in continued.items():
            assert torch.equal(resumed[name], want), f"rank {rank}: {name} differs after resuming"


def owner_on(mesh_shape, names):
    """A model on a fresh ``mesh_shape`` mesh, dedicated, and its normuon optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    model = expert_parallel(init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    ded = ddp.dedicate(model)
    return model, ded, DMuon(param_groups(model), distributed=ded, rule="normuon", **OPT)


def load_saved(how, path, whole, model, opt) -> None:
    """Load what :func:`run_save_on_dp_by_ep` saved: the DCP checkpoint at ``path``, or
    the whole state ``whole``."""
    from dmuon.integrations import checkpoint

    if how == "dcp":
        checkpoint.load(path, model, opt)
    else:
        checkpoint.load_full_state_dict(model, opt, whole)


def run_save_on_dp_by_ep(rank, world, path, how):
    """dp 2 × ep 2: two steps, a DCP save (or the whole state to rank 0), a third step."""
    from dmuon.integrations import checkpoint

    model, ded, opt = owner_on(*DP_EP)
    train(model, opt, range(2))
    whole = None
    if how == "dcp":
        checkpoint.save(path, model, opt)
    else:
        whole = checkpoint.full_state_dict(model, opt)
    train(model, opt, range(2, 3))
    ded.wait()
    return whole_params(model), whole


def run_load_on_ep(rank, world, path, how, whole):
    model, ded, opt = owner_on((world,), ("ep",))
    load_saved(how, path, whole, model, opt)
    train(model, opt, range(2, 3))
    ded.wait()
    return whole_params(model)


@pytest.mark.parametrize("how", ["dcp", "full"])
def test_owner_experts_saved_on_dp_by_ep_resume_on_ep_alone_and_in_one_process(tmp_path, how):
    """Saved on dp 2 × ep 2, each stack's state on its owner among the replicas alone, by
    DCP or as the whole state: resumed on ep 2 (2 ranks, every rank its experts' state) and
    in one process, the third step equals continuing (1e-6; the sums differ in order)."""
    from dmuon.integrations import checkpoint

    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(run_save_on_dp_by_ep, 4, args=(path, how), timeout=240)
    want, whole = saved[0]
    resumed = run_on_ranks(run_load_on_ep, 2, args=(path, how, whole), timeout=180)
    model = MoE()
    opt = DMuon(param_groups(model), rule="normuon", **OPT)
    load_saved(how, path, whole, model, opt)
    x, y = batch(2)
    F.mse_loss(model(x), y).backward()
    opt.step()
    fresh = MoE()  # the weights of step 2 with a fresh optimizer: what lost state looks like
    forgetful = DMuon(param_groups(fresh), rule="normuon", **OPT)
    if how == "dcp":
        checkpoint.load(path, fresh, DMuon(param_groups(fresh), rule="normuon", **OPT))
    else:
        fresh.load_state_dict(whole["model"])
    F.mse_loss(fresh(x), y).backward()
    forgetful.step()
    lost = max((fresh.state_dict()[n] - w).abs().max().item() for n, w in want.items())
    assert lost > 100 * TOLERANCE, "the optimizer state made no difference: void test"
    single = {n: p.detach() for n, p in model.named_parameters()}
    for what, got in [("rank 0", resumed[0]), ("rank 1", resumed[1]), ("one process", single)]:
        for name, w in want.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"resumed on {what}: {name} differs by {diff:.2e}"


class Block(nn.Module):
    """The MoE inside a block whose forward reads a stack before it calls the MoE (as a
    regulariser or a log of the experts' norms would): ``snapshots`` keeps what it read."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE()
        self.snapshots: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.moe.w_in
        self.snapshots.append((w.to_local() if hasattr(w, "to_local") else w).detach().clone())
        return self.moe(x)


class Nested(nn.Module):
    """A linear layer, then the block (layer ``blocks.0``): the next forward runs the linear
    layer while the experts' broadcasts back from their owners are still travelling.
    ``in_list``: the block inside a ``ModuleList`` the forward iterates and never calls
    (stacks ``blocks.0.0.moe.*``, whose layer key ``blocks.0`` names that list)."""

    def __init__(self, in_list: bool = False) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.first = nn.Linear(5, 5)
        self.blocks = nn.ModuleList([nn.ModuleList([Block()]) if in_list else Block()])

    @property
    def block(self) -> Block:
        inner = self.blocks[0]
        return inner[0] if isinstance(inner, nn.ModuleList) else inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.first(x))


def nested_on(mesh, in_list: bool = False) -> tuple[Nested, Any, DMuon]:
    """:class:`Nested` with its stacks split over ``ep``, dedicated, and its optimizer."""
    from dmuon.integrations import ddp

    model = Nested(in_list)
    split_experts(model.block.moe, mesh)
    ded = ddp.dedicate(model)
    return model, ded, DMuon(param_groups(model), distributed=ded, **OPT)


def run_nested(rank, world, in_list):
    """dp 2 × ep 2, :class:`Nested`: whether the experts' broadcasts are in flight when
    each forward enters ``first`` and the block (after the wait the dedication's hook
    does there); whether what the block read of a stack before calling the MoE was the
    stack as the MoE ran it; after the last step, in flight before and after
    ``model.state_dict()``, and whether the state dict held the replicas' final stacks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model, ded, opt = nested_on(mesh, in_list)
    block, publication = model.block, ded.exchange.publication
    seen: dict[str, list[bool]] = {"first": [], "block": []}
    model.first.register_forward_pre_hook(
        lambda *_: seen["first"].append(publication.experts.in_flight())
    )
    block.register_forward_pre_hook(
        lambda *_: seen["block"].append(publication.experts.in_flight())
    )
    ran = []  # the stack as the MoE ran it, each forward
    block.moe.register_forward_pre_hook(lambda *_: ran.append(block.moe.w_in.to_local().clone()))
    train(model, opt, range(STEPS))
    before = publication.experts.in_flight()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    after = publication.experts.in_flight()
    prefix = "blocks.0.0.moe" if in_list else "blocks.0.moe"
    same = all(
        torch.equal(saved[f"{prefix}.{n}"].to_local(), getattr(block.moe, n).to_local())
        for n in STACKS
    )
    current = all(torch.equal(a, b) for a, b in zip(block.snapshots, ran, strict=True))
    ded.wait()
    return seen, current, before, after, same, whole_params(model)


@pytest.mark.parametrize("in_list", [False, True], ids=["block", "block-in-a-list"])
def test_the_next_forward_waits_for_the_experts_only_where_it_reaches_their_layer(in_list):
    """The experts' broadcasts back from their owners travel on into the next forward:
    it runs the layer before the experts' with them in flight and waits in the pre-hook of
    the experts' layer (``blocks.0``; a ``ModuleList`` never called: the block under it),
    so a read of a stack anywhere in the block's forward is current;
    ``model.state_dict()`` waits for them too. The result equals one process."""
    expected = moving_reference("muon", make=lambda: Nested(in_list))
    for rank, (seen, current, before, after, same, got) in enumerate(
        run_on_ranks(run_nested, 4, args=(in_list,), timeout=120)
    ):
        # the first forward comes before any step: nothing in flight
        assert seen["first"] == [False, True, True], (rank, seen)
        # registered after the dedication's pre-hook on the block: its wait has run
        assert seen["block"] == [False, False, False], (rank, seen)
        assert current, f"rank {rank}: the block read a stack older than the MoE ran"
        assert (before, after, same) == (True, False, True), (rank, before, after, same)
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e}"


def run_unwaited(rank, world):
    """dp 2 × ep 2: the second forward calls the MoE's ``forward`` directly, past the hooks
    of its block and its own, while its experts are still in flight (landed on rank 0 by a
    ``state_dict()`` there alone); then, after ``zero_grad()``, a step as it should be."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model, ded, opt = nested_on(mesh)
    train(model, opt, range(1))
    if rank == 0:  # lands every broadcast on rank 0 alone: the refusal must not change
        model.state_dict()
    x, y = rank_batch(1)
    try:
        F.mse_loss(model.block.moe.forward(model.first(x)), y).backward()
        err = None
    except RuntimeError as e:
        err = str(e)
    opt.zero_grad()  # drops the iteration, finishing the reductions it launched
    train(model, opt, range(1, STEPS))
    ded.wait()
    return err, whole_params(model)


def test_a_forward_past_the_experts_layer_hooks_is_refused_on_every_rank():
    results = run_on_ranks(run_unwaited, 4, timeout=120)
    for rank, (err, _) in enumerate(results):
        assert err is not None and "it was not called" in err, (rank, err)
        assert "'blocks.0.moe.w_in'" in err or "'blocks.0.moe.w_out'" in err, (rank, err)
    # the iteration dropped, training goes on: every replica holds the same weights
    for name, want in results[0][1].items():
        for rank, (_, got) in enumerate(results):
            assert torch.equal(got[name], want), (rank, name)


def run_load_and_remove(rank, world):
    """dp 2 × ep 2, the broadcasts of a step in flight each time: ``load_state_dict`` of
    the initial state, by the model, then by the block alone, each followed by a forward
    (the loaded weights must stay); ``ded.remove()``, then a forward without hooks,
    against one after ``reinstall()`` and ``ded.wait()``; then a forward that reads a
    stack before its block runs (outside its layer: no error on any rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", DP_EP[0], mesh_dim_names=DP_EP[1])
    model, ded, opt = nested_on(mesh)
    x, y = rank_batch(0)
    loaded = []
    for module in (model, model.block):
        initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
        train(model, opt, range(1))
        assert ded.exchange.publication.experts.in_flight()
        module.load_state_dict(initial)
        with torch.no_grad():
            model(x)
        loaded.append(all(torch.equal(module.state_dict()[k], v) for k, v in initial.items()))
    train(model, opt, range(1, 2))
    ded.remove()
    with torch.no_grad():
        unhooked = model(x)
    ded.reinstall()
    ded.wait()
    with torch.no_grad():
        hooked = model(x)
    train(model, opt, range(2, 3))
    early = model.block.moe.w_in.to_local()  # read before the block's hooks wait
    try:
        (F.mse_loss(model(x), y) + early.square().sum()).backward()
        failed = None
    except RuntimeError as e:
        failed = str(e)
    return loaded, torch.equal(unhooked, hooked), failed


def test_loading_a_state_dict_or_removing_the_hooks_waits_for_the_broadcasts_in_flight():
    for rank, (loaded, same, failed) in enumerate(
        run_on_ranks(run_load_and_remove, 4, timeout=120)
    ):
        assert loaded == [True, True], f"rank {rank}: a broadcast overwrote the loaded weights"
        assert same, f"rank {rank}: a forward after remove() read weights still in flight"
        # the late read is stale on the receivers, as a dense weight's would be, but does
        # not fail backward on them alone (their owners would go on into the step)
        assert failed is None, (rank, failed)


def run_loaded_on_dp_rank_0(rank, world):
    """The ranks of ``dp`` coordinate 1 start from other weights than rank 0's (a model
    loaded on the first replica alone), experts and dense layers alike."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import ddp

    shape, names = DP_EP
    model = expert_parallel(init_device_mesh("cpu", shape, mesh_dim_names=names))
    if rank >= world // 2:  # dp is the outer dimension: ranks 2 and 3
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(torch.randn_like(local))
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    train(model, opt, range(STEPS))
    ded.wait()
    return whole_params(model)


def test_every_replica_starts_from_the_first_replicas_experts():
    """dp 2 × ep 2, the second replica's weights different before ``ddp.dedicate``: the
    dedication gives every rank rank 0's dense weights, and the optimizer every replica its
    set's first rank's experts, so training equals one process (without the experts'
    broadcast, the replicas trained their first step on their own experts and the owners
    among them kept theirs)."""
    expected = moving_reference("muon", 4)
    results = run_on_ranks(run_loaded_on_dp_rank_0, 4, timeout=180)
    for rank, got in enumerate(results):
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} off by {diff:.2e}"
