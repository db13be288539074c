"""Sign mode (Sign-Muon) on 2 and 4 ranks equals a single-process simulation of the vote.

The simulation keeps one momentum per simulated rank, runs the chain up to the
signs on each rank's own gradient, takes the majority written out here —
``S = sign(Σ_r s_r)``, a zero sign abstaining and a tie giving ``0`` — finishes the
chain on ``S`` and applies it; the scalar parameters take AdamW on the averaged
gradient, as sign mode does.
"""

from contextlib import nullcontext

import pytest
import torch
from distributed_cases import OPT, TOLERANCE, batch, build, full_params, loss_of, max_diff

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, apply_update, get_rule, matrix_layout, param_groups
from dmuon.optim.transforms import StepContext, run_chain

STEPS = 3
NAME = "mixed"


def run_sign(rank, world, name):
    model = build(name)
    opt = DMuon(param_groups(model), rule="sign_muon", mode="sign", **OPT)
    assert opt.mode == "sign"
    for t in range(STEPS):
        loss_of(name, model, *batch(name, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def simulate(name, world):
    model = build(name)
    opt = DMuon(param_groups(model), rule="sign_muon", **OPT)  # its scalar groups and hp
    rule = get_rule("sign_muon")
    assert type(rule.chain[3]).__name__ == "MajorityVote"
    before, after = rule.chain[:3], rule.chain[4:]
    matrices = [(p, g) for g in opt.param_groups if g["rule"] == "sign_muon" for p in g["params"]]
    momenta = [
        {p: torch.zeros(matrix_layout(p, g, "").flat) for p, g in matrices} for _ in range(world)
    ]
    for t in range(STEPS):
        grads = []
        for r in range(world):
            opt.zero_grad()
            loss_of(name, model, *batch(name, t, r, world)).backward()
            grads.append({p: p.grad.clone() for p in model.parameters()})
        with torch.no_grad():
            for p, g in matrices:
                shape = matrix_layout(p, g, "").flat
                signs = []
                for r in range(world):
                    G = grads[r][p].reshape(shape)
                    ctx = StepContext(grad=G, hp=g)
                    signs.append(run_chain(before, G, {"momentum_buffer": momenta[r][p]}, ctx))
                voted = torch.sign(sum(signs))
                ctx = StepContext(grad=grads[0][p].reshape(shape), hp=g)
                U = run_chain(after, voted, {}, ctx)
                apply_update(
                    [p.view(shape)],
                    [U],
                    lr=g["lr"],
                    weight_decay=g["weight_decay"],
                    scale=ctx.scale,
                )
                p.grad = None
        for p in model.parameters():  # scalars: the average of the ranks' gradients
            if p.grad is not None:
                p.grad = sum(gr[p] for gr in grads) / world
        opt.step()
    return full_params(model)


@pytest.mark.parametrize("world", [2, 4])
def test_sign_mode_equals_a_single_process_simulation_of_the_vote(world):
    expected = simulate(NAME, world)
    moved, _ = max_diff(expected, full_params(build(NAME)))
    assert moved > 1e-2
    results = run_on_ranks(run_sign, world, args=(NAME,), timeout=120)
    for rank in range(world):
        diff, where = max_diff(results[rank], expected)
        assert diff <= TOLERANCE, f"rank {rank}: {where} differs by {diff:.2e}"


def two_matrices() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False)
    )


def matrix_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + t)
    return torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)


def run_abstaining(rank, world):
    """Only rank 0 has gradients: every other rank steps zeros (its momentum stays zero,
    its signs are zeros) and abstains from the vote."""
    model = two_matrices()
    opt = DMuon(param_groups(model), rule="sign_muon", mode="sign", **OPT)
    for t in range(STEPS):
        if rank == 0:
            x, y = matrix_batch(t)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_without_a_gradient_abstain_so_the_vote_is_the_one_rank_that_has_one(world):
    """``S = sign(Σ_r s_r)`` with ``sign(0) = 0``: the ranks whose gradients are missing
    (stepped as zeros) leave rank 0's signs as they are, so every rank steps exactly as
    one process on rank 0's batches. (A vote counting a zero as ``+`` moved every entry
    of rank 0's ``−`` signs up instead, on 2 ranks as a tie, on 3 as the majority.)"""
    model = two_matrices()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = DMuon(param_groups(model), rule="sign_muon", **OPT)
    for t in range(STEPS):
        x, y = matrix_batch(t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved, _ = max_diff(expected, initial)
    assert moved > 1e-2
    for rank, got in enumerate(run_on_ranks(run_abstaining, world, timeout=120)):
        diff, where = max_diff(got, expected)
        assert diff <= TOLERANCE, f"rank {rank}: {where} differs by {diff:.2e}"


def run_reordered(rank, world, name):
    """Rank 1 lists every group's parameters in reverse. The scalars' gradients are
    averaged by name (one flat buffer per dtype; by position, rank 1's entries were summed
    with other parameters'), and the matrices are stacked for the vote by name (by
    position, same-shape matrices of a layer voted with each other's signs) — both
    silently, with the ranks' weights drifting apart."""
    model = build(name)
    groups = param_groups(model)
    if rank == 1:
        for g in groups:
            g["params"] = g["params"][::-1]
            if "param_names" in g:
                g["param_names"] = g["param_names"][::-1]
    opt = DMuon(groups, rule="sign_muon", mode="sign", **OPT)
    for t in range(STEPS):
        loss_of(name, model, *batch(name, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def test_ranks_listing_the_parameters_in_other_orders_step_as_the_simulation():
    expected = simulate(NAME, 2)
    for rank, got in enumerate(run_on_ranks(run_reordered, 2, args=(NAME,), timeout=120)):
        diff, where = max_diff(got, expected)
        assert diff <= TOLERANCE, f"rank {rank}: {where} differs by {diff:.2e}"


def run_missing_scalar(rank, world):
    from dmuon.optim import ModelMismatchError

    model = two_matrices()
    model[0].register_parameter("bias", torch.nn.Parameter(torch.zeros(8)))
    if rank == 1:  # the same model but for one scalar parameter
        model[0].bias = None
    try:
        DMuon(param_groups(model), rule="sign_muon", mode="sign", timeout=20, **OPT)
    except ModelMismatchError as err:
        return str(err)
    return None


def test_a_scalar_parameter_on_some_ranks_only_is_named_on_every_rank_when_built():
    """Sign mode all-reduces the scalars' gradients itself: a rank without one hung in
    another collective (or, for another shape, gloo aborted a rank)."""
    for rank, message in enumerate(run_on_ranks(run_missing_scalar, 2, timeout=90)):
        assert message is not None, f"rank {rank} built the optimizer"
        assert "'[all-reduced] 0.bias'" in message and "rank 1 lacks" in message, message


def run_swapped_state(rank, world):
    model = two_matrices()
    opt = DMuon(param_groups(model), rule="sign_muon", mode="sign", **OPT)
    x, y = matrix_batch(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    theirs = [None]
    torch.distributed.broadcast_object_list(theirs if rank else [opt.state_dict()], src=0)
    mine = opt.state_dict()
    with pytest.warns(UserWarning, match="rank 0 of 2 on rank 1 of 2") if rank else nullcontext():
        opt.load_state_dict(theirs[0] if rank else mine)
    return True


def test_another_ranks_sign_state_loads_with_a_warning():
    """Sign-Muon's momentum is each rank's own: rank 0's dict (what Lightning loads on
    every rank) resumes training, not rank 1's run, and says so; a rank's own loads
    silently."""
    assert run_on_ranks(run_swapped_state, 2, timeout=90) == [True, True]
