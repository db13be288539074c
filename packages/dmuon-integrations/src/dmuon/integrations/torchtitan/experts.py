"""torchtitan's expert stacks: which of its layouts DMuon steps, and a clear refusal of the other.

torchtitan 0.3.0 lays out a MoE layer's routed experts (``GroupedExperts``: stacks
``w1_EFD``, ``w2_EDF``, ``w3_EFD`` of shape ``(E, m, n)``) in two steps
(``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``, after
``model.parallelize``):

* with ``expert_parallel_degree`` ``ep`` > 1 the stacks are first split over ``ep`` on
  the expert dimension (``Shard(0)``), then FSDP2 shards them over ``efsdp`` (with
  ``efsdp × ep = dp_shard × cp × tp``) on dim 0 — placements
  ``(_StridedShard(0), Shard(0))`` on ``("efsdp", "ep")``, each rank whole experts —
  **unless** ``efsdp × ep > num_experts``, where it shards dim 1 instead:
  ``(Shard(1), Shard(0))``, each expert's rows split over ``efsdp``;
* with ``ep`` = 1, FSDP2 shards them over the dense ``fsdp`` mesh on dim 0
  (``Shard(0)``: whole experts) or, when the ``fsdp`` degree exceeds ``num_experts``,
  on dim 1 (``Shard(1)``).

DMuon's ``sharded`` mode steps a stack whose every shard is on the expert dimension
where it is (:attr:`dmuon.optim.engine.placements.MatrixPlacement.whole_experts`); it
does not gather an expert's rows from other ranks, so the ``Shard(1)`` layouts are
refused here, before any collective (placements are the same on every rank, so every
rank refuses alike), naming the parameter, its placements and what would work. So
are experts split by tensor parallelism (``ep`` = 1 with ``tp`` > 1: torchtitan
shards the stacks' matrix dimensions over ``tp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from dmuon.optim import SCALAR_RULES

__all__ = ["check_expert_stacks"]


def _shards(p: Any) -> list[tuple[int, int]]:
    """``(mesh dim, tensor dim)`` of each ``Shard``/``_StridedShard`` placement of ``p``."""
    out = []
    for d, pl in enumerate(getattr(p, "placements", ())):
        dim = getattr(pl, "dim", None)
        if isinstance(dim, int):
            out.append((d, dim % p.dim()))
    return out


def _refusal(name: str, p: Any, num_experts: int) -> str:
    mesh = p.device_mesh
    dims = tuple(mesh.mesh_dim_names or (f"dim{d}" for d in range(mesh.ndim)))
    shards = _shards(p)
    cut = sorted({dims[d] for d, t in shards if t != 0})
    head = (
        f"expert stack {name!r} (shape {tuple(p.shape)}) has placements "
        f"({', '.join(repr(pl) for pl in p.placements)}) on mesh dims {dims}: each expert is "
        f"split over mesh dim(s) {cut} (tensor dims {sorted({t for _, t in shards if t})}); "
        "DMuon steps whole experts where they are and does not gather an expert's pieces."
    )
    adamw = (
        " Or give the experts to DMuon's AdamW (a ParamGroupConfig with "
        "optimizer_kwargs={'rule': 'scalar'})."
    )
    if "tp" in cut:
        return (
            f"{head} torchtitan splits the experts over 'tp' without expert parallelism "
            "(expert_parallel_degree 1, tensor_parallel_degree > 1); with "
            "expert_parallel_degree > 1 it keeps every expert whole on its ranks (given "
            f"at least dp_shard × cp × tp experts), which mode='sharded' steps.{adamw}"
        )
    ranks = 1
    for d, _ in shards:
        ranks *= int(mesh.size(d))
    return (
        f"{head} torchtitan's FSDP2 shards each expert's rows when the ranks it shards "
        f"the experts over ({ranks}: efsdp × ep = dp_shard × cp × tp with expert "
        f"parallelism, dp_shard × cp without) outnumber num_experts ({num_experts}). Use "
        f"a model with at least {ranks} experts, or fewer of those ranks: torchtitan then "
        f"shards dim 0, whole experts per rank, which mode='sharded' steps.{adamw}"
    )


def check_expert_stacks(
    model: nn.Module, groups: Sequence[Mapping[str, Any]], default_rule: str
) -> None:
    """Refuse expert stacks whose rows or columns are sharded: DMuon steps whole experts
    only. A stack is a 3-D DTensor parameter of a matrix group that keeps it whole
    (``flatten=False``, as :func:`dmuon.optim.param_groups` groups expert stacks) or of
    a module with a ``num_experts`` attribute (torchtitan's ``GroupedExperts``).

    Args:
        model: the model part (for parameter names and each stack's ``num_experts``).
        groups: DMuon's parameter groups, before DMuon is built.
        default_rule: the rule of a group that names none.

    Raises:
        ValueError: naming the first such parameter, its placements, the mesh
            dimensions that split its experts, why torchtitan split them (the expert
            count and the rank count it compared, or tensor parallelism) and what would
            work.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    experts: dict[int, int] = {}
    for m in model.modules():
        count = getattr(m, "num_experts", None)
        if isinstance(count, int):
            experts.update({id(p): count for p in m.parameters(recurse=False)})
    scalar = {"scalar", *SCALAR_RULES}
    for group in groups:
        if group.get("rule", default_rule) in scalar:
            continue
        stacks = group.get("flatten") is False
        for p in group["params"]:
            if p.dim() != 3 or not hasattr(p, "placements"):
                continue
            if not (stacks or id(p) in experts):
                continue
            if all(t == 0 for _, t in _shards(p)):
                continue
            name = names.get(id(p), "?")
            raise ValueError(_refusal(name, p, experts.get(id(p), p.shape[0])))
