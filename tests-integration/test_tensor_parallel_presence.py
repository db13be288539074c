"""A gradient dropped on some ranks of a tensor-parallel group is refused on every rank, by
name where it is known, before the group's first collective over it; nothing is stepped.

DTensor's backward gives a parameter held over ``tp`` a gradient on every rank of it or
on none. A training loop that drops one (``p.grad = None`` on one ``tp`` rank) used to
leave the group's ranks in different collectives: a split matrix's Gram all-gather on
one rank, the next pending sum on the other, both ending at DMuon's deadline in an error
that named two collectives and no parameter; a matrix replicated whole over ``tp`` with
a ``Replicate()`` gradient (no collective at all) was stepped on one rank and not on the
other, silently. The gradient is dropped on one rank only: in ``replicated`` mode
(dp 2 × tp 2) the other dp row's tp group holds whole gradients, and its ranks refuse
too (the step's agreement carries the refusal) instead of waiting for the deadline.
Four layouts of ``PendingNet``, through the step and through ``clip_grad_norm_``
(whose settling of the gradients comes first):

* ``fc1.weight``: colwise (``Shard(0)``), a gradient of the parameter's placements;
* ``tok.weight``: rowwise with a ``Partial`` gradient (a reduce-scatter settles it);
* ``head.weight``: replicated whole, a ``Replicate()`` gradient (no collective);
* ``mix.weight``: replicated whole, a ``Partial`` gradient.

After the refusal, ``zero_grad()`` and the next iteration train exactly as a run that
never met the dropped gradient.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel_pending_sums import PendingNet, batch, loss_of, parallelize

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, GradientPresenceError, clip_grad_norm_, param_groups

OPT = dict(lr=0.02, ns_compute_dtype="float32", timeout=10.0)


def run_dropped(rank: int, world: int, mode: str, where: str, name: str) -> dict:
    from tensor_parallel_cases import mode_mesh

    from dmuon.optim.matrix_split import local_tensor

    mesh, tp, rows, row = mode_mesh(mode, world)
    dp = mesh["dp"].get_group() if mode == "replicated" else None

    def build():
        model = parallelize(PendingNet(), tp)
        return model, DMuon(param_groups(model), mode=mode, process_group=dp, **OPT)

    def backward(model, t):
        x, y = batch(t)
        part = slice(len(x) // rows * row, len(x) // rows * (row + 1))
        x, y = x[part], y[part]
        loss_of(model(x.chunk(tp.size())[tp.get_local_rank()]), y).backward()

    def step(model, opt):
        if where == "clip":
            clip_grad_norm_(opt, 1.0)
        opt.step()
        opt.zero_grad()

    model, opt = build()
    before = {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()}
    backward(model, 0)
    if rank == 1:  # tp rank 1 of the first dp row only: the other row's gradients are whole
        model.get_parameter(name).grad = None
    error = None
    try:
        step(model, opt)
    except GradientPresenceError as err:
        error = {"message": str(err), "names": err.names, "ranks": err.ranks}
    untouched = all(
        torch.equal(local_tensor(p).detach(), before[n]) for n, p in model.named_parameters()
    )
    opt.zero_grad()
    backward(model, 1)
    step(model, opt)
    # the same iteration on a run that never met the dropped gradient
    clean, clean_opt = build()
    backward(clean, 1)
    step(clean, clean_opt)
    same = all(
        torch.equal(local_tensor(p).detach(), local_tensor(q).detach())
        for p, q in zip(model.parameters(), clean.parameters(), strict=True)
    )
    return {
        "error": error,
        "untouched": untouched,
        "same": same,
        "tp_rank": tp.get_local_rank(),
        "faulty_group": rank < tp.size(),
        "steps": opt.steps_taken,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "world", "where", "name"),
    [
        ("single", 2, "step", "fc1.weight"),
        ("single", 2, "clip", "tok.weight"),
        ("single", 2, "step", "head.weight"),
        ("replicated", 4, "step", "mix.weight"),
        ("replicated", 4, "clip", "fc1.weight"),
    ],
)
def test_a_gradient_dropped_on_one_tensor_parallel_rank_is_refused_by_name(
    mode, world, where, name
):
    results = run_on_ranks(run_dropped, world, args=(mode, where, name), timeout=200)
    for rank, r in enumerate(results):
        err = r["error"]
        assert err is not None, f"rank {rank} stepped: {r}"
        # every rank refuses (the others' step agreement carries it): none waits
        assert err["ranks"] == [0, 1], (rank, err)
        if r["faulty_group"]:
            assert err["names"] == [name], (rank, err)
            held = "missing" if r["tp_rank"] == 1 else "present"
            said = f"{name!r} (on 1 of 2 ranks of group [0, 1]; {held} on this rank)"
            assert said in err["message"], err
        else:
            assert err["names"] == [] and "on other ranks' groups" in err["message"], err
        assert r["untouched"], f"rank {rank}: a parameter changed in the refused step"
        assert r["same"], f"rank {rank}: the next iteration differs from a clean run's"
        assert r["steps"] == 1, r
