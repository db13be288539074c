"""Stochastic rounding of bf16 state draws its bits by parameter *name*, not position.

``state_rounding="stochastic"`` seeds each matrix's random bits from the step, the
parameter's name and its block (:func:`dmuon.optim.state_precision.rounding_seed`).
The rest of DMuon lets ranks list a group's parameters in different orders (state is
built and batched in the order of the names); a seed from the parameter's position in
its group gave a reordered listing other bits: two optimizers over the same named
parameters diverged, and ranks of a ``mode="single"`` run under an all-reduced gradient
drifted apart silently. The reference here is the same optimizer with the parameters
listed in their natural order: equality is bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups
from dmuon.optim.state_precision import rounding_seed

KW = dict(lr=0.05, state_dtype="bfloat16", state_rounding="stochastic", ns_compute_dtype="float32")


class Stack(torch.nn.Module):
    """Four same-shape hidden matrices (one stacked bucket: positions matter), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 24)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(4))
        self.out = torch.nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def _data(t: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x[:, :4] * 2)


def _reversed(groups: list[dict]) -> list[dict]:
    """The same groups, each listing its parameters (and their names) back to front."""
    return [dict(g, params=g["params"][::-1], param_names=g["param_names"][::-1]) for g in groups]


def _matrix_state(opt: DMuon, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{k}": v
        for name, p in model.named_parameters()
        for k, v in opt.state[p].items()
        if v.dtype == torch.bfloat16
    }


def test_a_group_listed_in_another_order_rounds_state_to_the_same_bits():
    a_model, b_model = Stack(), Stack()
    a = DMuon(param_groups(a_model), **KW)
    b = DMuon(_reversed(param_groups(b_model)), **KW)
    listed = [g["param_names"] for g in a.param_groups]
    assert [g["param_names"] for g in b.param_groups] == [n[::-1] for n in listed] != listed
    for t in range(4):
        for model, opt in ((a_model, a), (b_model, b)):
            x, y = _data(t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    sa, sb = _matrix_state(a, a_model), _matrix_state(b, b_model)
    assert sa and sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key}: state differs with the group reversed"
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs with the group reversed"


def test_the_seed_is_the_names_not_the_position():
    # same step, block and shape: the name decides; a position (groups without names)
    # is another matrix than any name
    seeds = {rounding_seed(3, f"hidden.{i}.weight", 0, (24, 24)) for i in range(4)}
    assert len(seeds) == 4
    assert rounding_seed(3, "hidden.0.weight", 0, (24, 24)) not in {
        rounding_seed(3, i, 0, (24, 24)) for i in range(4)
    }
    # a rank's part of a parameter (a shard, its experts) draws its own bits
    assert rounding_seed(3, "w", 0, (24, 24), (-2, 12)) != rounding_seed(3, "w", 0, (24, 24))


def run_reversed_single(rank: int, world: int) -> list[torch.Tensor]:
    model = Stack()
    groups = param_groups(model)
    opt = DMuon(_reversed(groups) if rank == 1 else groups, mode="single", **KW)
    for t in range(4):
        x, y = _data(t, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # a plain all-reduced gradient, as DDP's
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_ranks_listing_a_group_in_other_orders_stay_equal_in_single_mode():
    p0, p1 = run_on_ranks(run_reversed_single, 2, timeout=120)
    names = [n for n, _ in Stack().named_parameters()]
    for name, a, b in zip(names, p0, p1, strict=True):
        assert torch.equal(a, b), f"{name}: rank 1 (group reversed) diverged from rank 0"
