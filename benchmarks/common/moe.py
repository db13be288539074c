"""A soft-routed mixture-of-experts model and its expert-parallel dispatch, in plain torch.

The experts of a block are two stacks, ``w_in (E, h, d)`` and ``w_out (E, d, h)`` (what
:func:`dmuon.optim.param_groups` puts in a matrix group with ``flatten=False``: a batch
of ``E`` matrices). Every token goes to every expert, weighted by its softmax gate (no
top-k: no routing decision flips on a rounding difference, so a distributed run can be
compared with one process).

Expert parallelism is the usual dispatch, written with plain collectives over the ``ep``
group: every rank gathers the group's tokens (:class:`GatherTokens`), runs its own
experts on all of them, and the partial outputs are summed back to the tokens' ranks
(:class:`ScatterSum`, a reduce-scatter). Gradients then arrive as in a real EP run: an
expert's is complete over ``ep`` (every ``ep`` rank's loss summed into it), a dense
matrix's is this rank's part.

Example:
    >>> import torch
    >>> model = MoEModel(d_in=5, d=8, hidden=16, experts=4, layers=2, d_out=3)
    >>> model(torch.randn(6, 5)).shape
    torch.Size([6, 3])
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GatherTokens",
    "MoEBlock",
    "MoEModel",
    "ScatterSum",
    "expert_mix",
    "expert_parallel",
    "finish_gradients",
    "split_experts",
]


def expert_mix(
    h: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor
) -> torch.Tensor:
    """``Σ_e gate[:, e] · w_out[e] · gelu(w_in[e] · h)`` over the experts given."""
    a = F.gelu(torch.einsum("bd,ehd->ebh", h, w_in))
    return torch.einsum("ebh,edh,be->bd", a, w_out, gate)


class GatherTokens(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order; backward: the summed gradient's rows
    of this rank (every rank's loss reached them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[me * rows : (me + 1) * rows], None


class ScatterSum(torch.autograd.Function):
    """This rank's rows of the sum over the group (a reduce-scatter); backward: gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        rows = total.shape[0] // dist.get_world_size(group)
        me = dist.get_rank(group)
        return total[me * rows : (me + 1) * rows].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class MoEBlock(nn.Module):
    """``x + experts(norm(x)) + mlp(norm(x))``: a router ``d → E``, two expert stacks and
    a dense ``d → d`` layer."""

    def __init__(self, d: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(d))
        self.w_out = nn.Parameter(torch.randn(experts, d, hidden) / math.sqrt(hidden))
        self.mlp = nn.Linear(d, d)
        self.ep: Any = None  # the ep group once the stacks are split (expert_parallel)
        self.register_buffer("local_experts", torch.arange(experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gate = F.softmax(self.router(h), dim=-1)
        if self.ep is None:
            y = expert_mix(h, gate, self.w_in, self.w_out)
        else:
            tokens = GatherTokens.apply(h, self.ep)
            gates = GatherTokens.apply(gate, self.ep)[:, self.local_experts]
            local = expert_mix(tokens, gates, self.w_in.to_local(), self.w_out.to_local())
            y = ScatterSum.apply(local, self.ep)
        return x + y + self.mlp(F.gelu(h))


class MoEModel(nn.Module):
    """An input layer, ``layers`` :class:`MoEBlock` and an output layer, seeded."""

    def __init__(
        self,
        *,
        d_in: int,
        d: int,
        hidden: int,
        experts: int,
        layers: int,
        d_out: int,
        seed: int = 0,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(d_in, d)
            self.blocks = nn.ModuleList(MoEBlock(d, hidden, experts) for _ in range(layers))
            self.out = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def split_experts(module: nn.Module, mesh: Any) -> nn.Module:
    """Split ``module``'s stacks ``w_in`` and ``w_out`` over the mesh's ``ep`` dimension
    (``Shard(0)``, with ``Replicate()`` on any other) with torch's public
    ``distribute_tensor``, and set its ``ep`` group and ``local_experts`` (the indices of the
    experts this rank holds), which its forward dispatches with; returns ``module``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = [Shard(0) if n == "ep" else Replicate() for n in mesh.mesh_dim_names]
    experts = module.w_in.shape[0]
    for name in ("w_in", "w_out"):
        whole = getattr(module, name).detach()
        setattr(module, name, nn.Parameter(distribute_tensor(whole, mesh, placements)))
    module.ep = mesh.get_group("ep")
    module.local_experts = distribute_tensor(torch.arange(experts), mesh, placements).to_local()
    return module


def expert_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """:func:`split_experts` of every :class:`MoEBlock` of ``model``; returns ``model``."""
    for block in model.modules():
        if isinstance(block, MoEBlock):
            split_experts(block, mesh)
    return model


def finish_gradients(model: nn.Module, mesh: Any) -> None:
    """Gradients as DDP would leave them: the dense ones averaged over every rank, the
    experts' (complete over ``ep``) summed over the mesh's ``dp`` dimension, if any, and
    divided by the world (the global loss is the mean of the ranks' means)."""
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    dp = mesh.get_group("dp") if "dp" in mesh.mesh_dim_names else None
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p, DTensor):  # an expert stack
            g = p.grad.to_local()
            if dp is not None:
                dist.all_reduce(g, group=dp)
        else:
            g = p.grad
            dist.all_reduce(g)
        g.div_(world)
