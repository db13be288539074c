"""Owner mode refuses a gradient changed between backward and ``step()``.

Each gradient leaves for its owner as backward produces it, so what a training loop
does to ``p.grad`` afterwards (``torch.nn.utils.clip_grad_norm_``, a manual rescale,
a replaced gradient) never reaches the step. Before, such a change was silently lost
(the clip did not clip); now the step's agreement raises
:class:`~dmuon.optim.GradientChangedError` on every rank, naming the parameters and
the ranks, updates nothing, and leaves the optimizer usable.

A change is seen by the gradient's version counter: writes that do not count one
(through ``.data``; ``GradScaler.unscale_``'s fused kernel, checked below; the foreach
kernels on DTensor gradients) are not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed_cases import gelu_mlp
from torch import nn

from dmuon.comm.testing import run_on_ranks


def change(m: nn.Module, how: str, rank: int) -> None:
    """What a training loop might do to the gradients between backward and step."""
    if how == "torch_clip":
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    elif how == "rank1_rescales" and rank == 1:
        for p in m.parameters():
            p.grad.mul_(0.5)
    elif how == "replaced":
        m[0].weight.grad = m[0].weight.grad.clone()


def run(rank: int, world: int, how: str) -> dict[str, object]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, GradientChangedError, clip_grad_norm_, param_groups

    m = gelu_mlp()
    ded = ddp.dedicate(m)
    opt = DMuon(param_groups(m), distributed=ded, lr=0.02, ns_compute_dtype=torch.float32)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(m(x), torch.zeros(4, 4)).backward()
    change(m, how, rank)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    out: dict[str, object] = {}
    try:
        opt.step()
    except GradientChangedError as err:
        out.update(ranks=err.ranks, names=err.names, message=str(err))
    ded.wait()
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    out["steps"] = opt.steps_taken
    # the optimizer stays usable: the next step, clipped the DMuon way, runs
    opt.zero_grad()
    F.mse_loss(m(x), torch.zeros(4, 4)).backward()
    clip_grad_norm_(opt, 1e-3)
    opt.step()
    ded.wait()
    out["steps_after"] = opt.steps_taken
    return out


@pytest.mark.parametrize("how", ["torch_clip", "rank1_rescales", "replaced"])
def test_a_gradient_changed_after_backward_raises_on_every_rank(how):
    results = run_on_ranks(run, 2, args=(how,), timeout=120)
    changed_on = [1] if how == "rank1_rescales" else [0, 1]
    for rank, out in enumerate(results):
        assert out.get("ranks") == changed_on, (rank, out)
        assert out["unchanged"], f"rank {rank}: a parameter moved in the refused step"
        assert out["steps"] == 0 and out["steps_after"] == 1, (rank, out)
        assert "dmuon.optim.clip_grad_norm_" in out["message"]
        if rank in changed_on:
            assert out["names"], (rank, out)
        else:
            assert out["names"] == [], (rank, out)


def test_what_the_version_counter_does_not_see():
    """The limit of the check, stated in the docs: ``GradScaler.unscale_`` rescales the
    gradients in place without counting a version (so owner mode cannot see it; its
    loss-scaled steps go through ``opt.unscale_``, ``test_loss_scaling.py``), nor does a
    write through ``.data``. If torch starts counting them, this fails and the docs'
    limit can go."""
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    version = p.grad._version
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # makes its scale
    scaler.unscale_(torch.optim.SGD([p], lr=0.1))
    p.grad.data.mul_(2.0)
    assert torch.equal(p.grad, torch.full((3,), 0.5))
    assert p.grad._version == version


def run_loop(rank: int, world: int, scalars: str, dmuon_clip: bool) -> dict[str, dict]:
    """Three steps with each ``zero_grad`` mode: after ``zero_grad(set_to_none=False)`` the
    owners' gradients are views of the reduction buckets, written again by the next
    backward and the next reduction: none of that is a change by the loop."""
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, clip_grad_norm_, param_groups

    out = {}
    for set_to_none in (True, False):
        m = gelu_mlp()
        ded = ddp.dedicate(m, scalars=scalars)
        opt = DMuon(param_groups(m), distributed=ded, lr=0.02, ns_compute_dtype=torch.float32)
        for t in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * t + rank))
            F.mse_loss(m(x), torch.zeros(4, 4)).backward()
            if dmuon_clip:
                clip_grad_norm_(opt, 0.05)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        ded.wait()
        out[str(set_to_none)] = {n: p.detach().clone() for n, p in m.named_parameters()}
    return out


@pytest.mark.parametrize("dmuon_clip", [False, True], ids=["plain", "dmuon_clip"])
@pytest.mark.parametrize("scalars", ["all_reduce", "owner"])
def test_zero_grad_keeping_the_gradients_is_no_change(scalars, dmuon_clip):
    results = run_on_ranks(run_loop, 2, args=(scalars, dmuon_clip), timeout=120)
    for rank, out in enumerate(results):
        for name, want in out["True"].items():
            assert torch.equal(out["False"][name], want), f"rank {rank}: {name}"
