"""The expert-parallel model the expert tests share: a soft-routed MoE whose expert stacks
split over an ``ep`` mesh dimension, its dispatch written with plain collectives, and the
one-process reference it is compared with.

The parallel forward is the usual expert-parallel dispatch, the one of the benchmarks'
:mod:`benchmarks.common.moe`: every rank embeds its own tokens, the ``ep`` group gathers
them, each rank runs its experts on all of them, and the partial outputs are summed back
to the tokens' ranks (a reduce-scatter). Gradients then arrive as in a real EP run: an
expert's is complete over its ``ep`` group (every rank's loss summed into it), a dense
matrix's is this rank's part.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_cases import CHECK
from torch import nn

from benchmarks.common.moe import GatherTokens, ScatterSum, expert_mix, split_experts
from dmuon.optim import DMuon, param_groups

OPT = dict(lr=0.02, weight_decay=0.01, momentum=0.9, ns_compute_dtype=torch.float32, **CHECK)
RULES = ("muon", "normuon", "dion3")
STEPS = 3
BATCH = 16  # global tokens per step, split evenly over the ranks
D, H = 6, 8  # model width, expert hidden width: w_in (E, 8, 6), w_out (E, 6, 8)
# Both runs orthogonalise the same matrices in fp32; the gradients differ only in the
# order of their sums (over the ranks' all-reduces, and over experts in the MoE
# output), a few fp32 ulps. After 3 steps the parameters agree to 4.8e-7 at most
# (measured over every rule, mesh and parameter here; entries are O(1)); an expert
# stepped with another's gradient, or with a wrongly scaled one, is off by ~lr = 2e-2.
TOLERANCE = 2e-6


class MoE(nn.Module):
    """in (5 → 6), a soft-routed MoE of ``experts`` experts (router 6 → E; experts
    6 → 8 → 6 stored as two stacks), a LayerNorm, out (6 → 3).

    Every token goes to every expert, weighted by its softmax gate: no top-k, so no
    routing decision can flip between the runs on a rounding difference.
    """

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(5, D)
            self.router = nn.Linear(D, experts, bias=False)
            self.w_in = nn.Parameter(torch.randn(experts, H, D) / math.sqrt(D))
            self.w_out = nn.Parameter(torch.randn(experts, D, H) / math.sqrt(H))
            self.norm = nn.LayerNorm(D)
            self.out = nn.Linear(D, 3)
        self.ep: dist.ProcessGroup | None = None
        self.local_experts = torch.arange(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gate = F.softmax(self.router(h), dim=-1)
        if self.ep is None:
            y = expert_mix(h, gate, self.w_in, self.w_out)
        else:  # dispatch to the experts' ranks, combine back (see the module docstring)
            tokens = GatherTokens.apply(h, self.ep)
            gates = GatherTokens.apply(gate, self.ep)[:, self.local_experts]
            part = expert_mix(tokens, gates, self.w_in.to_local(), self.w_out.to_local())
            y = ScatterSum.apply(part, self.ep)
        return self.out(self.norm(h + y))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + t)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def rank_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``t`` (``BATCH`` split evenly over the world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = BATCH // world
    x, y = batch(t)
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def backward_on_rank(model: nn.Module, t: int = 0) -> None:
    """The loss of this rank's slice of global batch ``t``, back-propagated."""
    x, y = rank_batch(t)
    F.mse_loss(model(x), y).backward()


def whole_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor's gathered), detached copies."""
    return {
        n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for n, p in model.named_parameters()
    }


def reference(rule: str, experts: int = 4, steps=range(STEPS)) -> dict[str, torch.Tensor]:
    """One process, the whole global batch each step."""
    return clipped_reference(rule, None, experts, steps)[0]


def clipped_reference(
    rule: str,
    clip: float | None,
    experts: int = 4,
    steps=range(STEPS),
    make: Callable[[], nn.Module] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """:func:`reference` with the gradients clipped to the global norm ``clip`` before each
    step by torch's ``clip_grad_norm_`` (checked to bind on every step), and each step's
    norm (``None``: not clipped, no norms). ``make``: the model (default ``MoE(experts)``)."""
    model = make() if make is not None else MoE(experts)
    opt = DMuon(param_groups(model), rule=rule, **OPT)
    norms = []
    for t in steps:
        x, y = batch(t)
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    assert clip is None or min(norms) > clip, f"clipping at {clip} binds not on every step"
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def expert_parallel(mesh, experts: int = 4) -> MoE:
    """MoE with its stacks ``Shard(0)`` on the mesh's ``ep`` dimension, ``Replicate()`` on
    any other (:func:`benchmarks.common.moe.split_experts`)."""
    return split_experts(MoE(experts), mesh)


def moving_reference(
    rule: str, experts: int = 4, make: Callable[[], nn.Module] | None = None
) -> dict[str, torch.Tensor]:
    """:func:`reference` (of ``make()``, default ``MoE(experts)``), checked to have moved the
    weights by far more than the tests' tolerance (otherwise a comparison with it would
    prove nothing)."""
    make = make if make is not None else lambda: MoE(experts)
    initial = {n: p.detach().clone() for n, p in make().named_parameters()}
    expected = clipped_reference(rule, None, experts, make=make)[0]
    moved = max((expected[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-3, f"{rule}: the reference barely moved; the test would prove nothing"
    return expected
