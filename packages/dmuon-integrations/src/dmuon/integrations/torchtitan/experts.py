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
rank refuses alike), naming the parameter, its placements and what would work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from dmuon.optim import SCALAR_RULES

__all__ = ["check_expert_stacks"]


def _matrix_dim_shards(p: Any) -> list[int]:
    """The tensor dims other than the leading (expert) one that ``p``'s placements shard."""
    out = []
    for pl in getattr(p, "placements", ()):
        dim = getattr(pl, "dim", None)  # Shard, _StridedShard
        if isinstance(dim, int) and dim % p.dim() != 0:
            out.append(dim % p.dim())
    return out


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
        ValueError: naming the first such parameter, its placements, the expert count
            and the rank count that torchtitan compared, and what would work.
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
            split = _matrix_dim_shards(p)
            if not split:
                continue
            mesh = p.device_mesh
            dims = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
            placements = ", ".join(repr(pl) for pl in p.placements)
            num = experts.get(id(p), p.shape[0])
            raise ValueError(
                f"expert stack {names.get(id(p), '?')!r} (shape {tuple(p.shape)}) has placements "
                f"({placements}) on mesh dims {tuple(dims)}: each expert's tensor dim "
                f"{split[0]} is split over ranks. torchtitan's FSDP2 shards the experts "
                "this way when the ranks it shards them over (efsdp × ep = dp_shard × cp × tp "
                f"= {mesh.size()}) outnumber num_experts ({num}); DMuon steps whole experts "
                "where they are and does not gather an expert's rows. Use a model with at "
                f"least {mesh.size()} experts or fewer dp_shard × cp × tp ranks (torchtitan "
                "then shards dim 0: whole experts per rank, which mode='sharded' steps), or "
                "give the experts to DMuon's AdamW (a ParamGroupConfig with "
                "optimizer_kwargs={'rule': 'scalar'})"
            )
