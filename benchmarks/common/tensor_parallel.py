"""Tensor parallelism for the benchmarks' GPT, and the vanilla Muon that gathers every shard.

:func:`parallelize_blocks` splits each block over a ``tp`` mesh with torch's public
styles, as Megatron does: the MLP's ``fc`` and, when the GPT has separate q/k/v
projections (``qkv="separate"``), the attention's ``q``, ``k``, ``v`` by rows
(``ColwiseParallel``, ``Shard(0)``: each rank a block of heads), the MLP's and the
attention's ``proj`` by columns (``RowwiseParallel``, ``Shard(1)``). A fused
``qkv`` projection stays whole (a row split would mix q, k and v).

:class:`GatherMuon` is the baseline the tensor-parallel Gram path is measured
against: what an implementation that knows nothing of tensor parallelism has to do
to be correct. Every rank all-gathers every split matrix's gradient
(``DTensor.full_tensor``), runs the whole-matrix Muon step on a full copy of the
weight (the same DMuon rule and kernels, ``mode="single"``, so only the distribution
differs), and keeps its own shard of the result. Traffic per split ``m × n`` matrix
and step: an all-gather of ``(t−1)/t · m·n`` elements; work: the whole matrix's
Newton–Schulz on every rank.

:func:`average_over` averages the gradients' local parts over the data-parallel
group of a ``dp × tp`` mesh (DDP's all-reduce, which DDP itself does not run on a
tensor-parallel model here).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["GatherMuon", "average_over", "parallelize_blocks", "predicted_split_bytes"]


def parallelize_blocks(model: nn.Module, mesh: Any) -> nn.Module:
    """Split every block's MLP over ``mesh``, and its attention when q/k/v are separate and
    the ranks divide the heads."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block.mlp, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        heads_split = block.attn.n_head % mesh.size() == 0
        if hasattr(block.attn, "q") and heads_split:  # separate q/k/v: a block of heads each
            styles = {n: ColwiseParallel() for n in ("q", "k", "v")}
            parallelize_module(block.attn, mesh, {**styles, "proj": RowwiseParallel()})
    return model


def predicted_split_bytes(opt: Any) -> float | None:
    """Bytes this rank is predicted to send in one step's tensor-parallel collectives: for
    every split matrix it steps, the path DMuon takes (``tp_path``; a rule that needs the
    whole matrix gathers) priced by :func:`dmuon.comm.tensor_parallel_path`. ``None``
    for an optimizer that is not DMuon. The engine chooses per batch of same-shape
    matrices (the α terms grow with the batch), this per matrix: a borderline shape may
    go the other way, and a batch of ``B`` matrices sends its normalisation's
    ``B + (B + 1)`` fp32 entries in two all-reduces, where ``B`` single matrices are priced
    at ``1 + 2`` each (``4·(B − 1)`` bytes more, before the ring's factor). Each path
    is priced in what it sends: the Gram matrices in the compute dtype, the gathered
    shards in the chain's."""
    from dmuon.comm import tensor_parallel_path
    from dmuon.kernels import default_compute_dtype
    from dmuon.optim import DMuon, get_rule
    from dmuon.optim.rules import RULES
    from dmuon.optim.transforms.base import resolve_compute_dtype

    if not isinstance(opt, DMuon):
        return None
    engine, total = opt.engine, 0.0
    for group in opt.param_groups:
        if group["rule"] not in RULES:
            continue
        rule = get_rule(group["rule"])
        for p in group["params"]:
            split = engine.split_of(p)
            if split is None or split.world_size < 2 or not engine.steps(p):
                continue
            m, n = split.shape
            # the Gram matrices travel in the compute dtype, the gathered shards in the
            # chain's: the parameter's, widened to fp32 under state_dtype
            compute = resolve_compute_dtype(group["ns_compute_dtype"])
            if compute is None:
                compute = default_compute_dtype(p.device, "gram")
            chain = p.dtype
            if group.get("state_dtype") is not None:
                chain = torch.promote_types(p.dtype, torch.float32)
            choice = tensor_parallel_path(
                m,
                n,
                split.dim,
                split.world_size,
                gram_element_size=compute.itemsize,
                gather_element_size=chain.itemsize,
                method=group["ns_method"],
                steps=group["ns_steps"],
            )
            path = choice.path if group["tp_path"] == "auto" else group["tp_path"]
            if not rule.splits:
                path = "gather"
            total += choice.gram_bytes if path == "gram" else choice.gather_bytes
    return total


def average_over(model: nn.Module, group: Any) -> None:
    """Average every gradient's local part over ``group`` (what DDP does over ``dp``).

    One flat all-reduce per dtype of the local tensors (a split matrix's shard, a
    plain tensor whole): the data-parallel average of a ``dp × tp`` mesh, where DDP
    itself does not take the tensor-parallel model.
    """
    import torch.distributed as dist

    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grads.setdefault(g.dtype, []).append(g)
    n = dist.get_world_size(group)
    for tensors in grads.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        flat.div_(n)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class GatherMuon:
    """Vanilla Muon on a tensor-parallel model: gather each split matrix, step it whole.

    Args:
        model: the parallelised model.
        make: ``make(param_groups) → optimizer``, e.g. ``lambda g: DMuon(g, mode="single",
            lr=...)``; it gets the model's groups with every split matrix replaced by a
            full, plain copy.
    """

    def __init__(self, model: nn.Module, make: Any) -> None:
        from dmuon.optim import param_groups
        from dmuon.optim.engine import placement_of

        self.pairs: list[tuple[torch.Tensor, nn.Parameter]] = []
        groups = []
        for g in param_groups(model):
            g = dict(g)
            params = []
            for name, p in zip(g["param_names"], g["params"], strict=True):
                if g.get("rule") != "scalar" and placement_of(p, name).tensor_split:
                    full = nn.Parameter(p.detach().full_tensor().clone())
                    self.pairs.append((p, full))
                    params.append(full)
                else:
                    params.append(p)
            g["params"] = params
            groups.append(g)
        self.opt = make(groups)

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import distribute_tensor

        for p, full in self.pairs:
            full.grad = None if p.grad is None else p.grad.full_tensor()  # type: ignore[attr-defined]
        self.opt.step()
        for p, full in self.pairs:  # this rank's shard of the new whole weight
            mine = distribute_tensor(full.detach(), p.device_mesh, p.placements, src_data_rank=None)  # type: ignore[attr-defined]
            p.to_local().copy_(mine.to_local())  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            p.grad = None
