"""The optimizer's parameters as the engine sees them: named, layered, planned.

Every rank must describe its parameters the same way, or the collectives of two
ranks will not match. A parameter is named by the group's ``param_names``
(:func:`~dmuon.optim.param_groups` provides them) or, without names, by its
position (``"group0.param3"``); it belongs to the *layer* of its name
(:func:`dmuon.comm.layer_key`: ``blocks.3.mlp.fc.weight`` → ``blocks.3``), the unit
in which gradients are reduced, results published and the step pipelined. A
frozen parameter (``requires_grad=False``) never has a gradient and is left out
on every rank alike; a tied weight appears once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dmuon.comm import MatrixItem, OwnerPlan, OwnerUnit, layer_key
from dmuon.comm.owner_plan import natural_key
from dmuon.optim.matrix_split import PLAIN_TENSOR_TYPES
from dmuon.optim.rules import RULES

__all__ = [
    "EngineParam",
    "collect_params",
    "frozen_params",
    "is_dtensor",
    "item_shape",
    "layers_in_order",
    "subplan",
    "unnarrowed_norms",
]


_DTENSOR: list[type] = []  # the DTensor class, once imported (lazily: a slow import)


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters)."""
    if type(t) in PLAIN_TENSOR_TYPES:  # the common case: no import, no isinstance
        return False
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without distributed
            return False
        _DTENSOR.append(DTensor)
    return isinstance(t, _DTENSOR[0])


@dataclass(frozen=True, eq=False)
class EngineParam:
    """One parameter of the optimizer, as the engine plans it.

    Attributes:
        name: stable name, the same on every rank.
        param: the parameter.
        group_index: its param group.
        index: its position in the group.
        matrix: True when the group runs a matrix rule (False: AdamW/Lion).
        layer: its layer key.
        item: what is planned and communicated for it: the name, the shape the
            owner orthogonalises (a conv weight ``(out, in, k, k)`` as
            ``(out, in·k·k)``; 0-/1-D parameters as ``(1, numel)``), its dtype and
            layer.
    """

    name: str
    param: torch.Tensor
    group_index: int
    index: int
    matrix: bool
    layer: str
    item: MatrixItem


def item_shape(p: torch.Tensor, group: Mapping[str, Any]) -> tuple[int, ...]:
    """The planned shape of ``p``: rows stay dim 0 (sharding and chunking keep working).

    Examples:
        >>> import torch
        >>> item_shape(torch.zeros(8, 3, 3, 3), {"flatten": True})
        (8, 27)
        >>> item_shape(torch.zeros(4, 8, 16), {"flatten": False}), item_shape(torch.zeros(5), {})
        ((4, 8, 16), (1, 5))
    """
    shape = tuple(int(d) for d in p.shape)
    if len(shape) < 2:
        return (1, math.prod(shape))
    if len(shape) > 2 and group.get("flatten"):
        return (shape[0], math.prod(shape[1:]))
    return shape


def collect_params(
    param_groups: Sequence[Mapping[str, Any]],
    layer_of: Callable[[str], str] = layer_key,
) -> list[EngineParam]:
    """Every trainable parameter of ``param_groups``, named and layered, in group order.

    Raises:
        ValueError: two parameters with the same name.
    """
    out: list[EngineParam] = []
    seen: dict[str, int] = {}
    for gi, group in enumerate(param_groups):
        matrix = group["rule"] in RULES
        for i, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            name = _name(group, gi, i)
            if name in seen:
                raise ValueError(
                    f"two parameters are both named {name!r} (param groups {seen[name]} and "
                    f"{gi}); the distributed engine needs unique names (param_names)"
                )
            seen[name] = gi
            layer = layer_of(name)
            item = MatrixItem(name, item_shape(p, group), p.dtype, layer)
            out.append(EngineParam(name, p, gi, i, matrix, layer, item))
    return out


def frozen_params(param_groups: Sequence[Mapping[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """The parameters of ``param_groups`` that do not require a gradient, named as
    :func:`collect_params` names parameters, in group order."""
    return [
        (_name(group, gi, i), p)
        for gi, group in enumerate(param_groups)
        for i, p in enumerate(group["params"])
        if not p.requires_grad
    ]


def _name(group: Mapping[str, Any], gi: int, i: int) -> str:
    """Parameter ``i`` of group ``gi``: its ``param_names`` entry, or ``group{gi}.param{i}``."""
    names = group.get("param_names")
    return names[i] if names is not None and i < len(names) else f"group{gi}.param{i}"


def layers_in_order(params: Iterable[EngineParam]) -> list[str]:
    """Distinct layer keys in natural order (``blocks.2`` before ``blocks.10``): the
    forward order of the usual ``nn.ModuleList`` stacks, and the same on every rank."""
    return sorted({p.layer for p in params}, key=natural_key)


def subplan(
    plan: OwnerPlan,
    names: Iterable[str],
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> OwnerPlan:
    """The part of ``plan`` that covers ``names``: same owners, world and replicate sizes.

    Used to run a collective on one pipeline group at a time. ``shapes`` replaces the
    shape of the items it names: what travels for a tensor-parallel matrix is this
    rank's shard, while the plan balanced the whole matrix.

    Examples:
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> items = [MatrixItem(f"h.{i}.w", (8, 8), layer=f"h.{i}") for i in range(4)]
        >>> plan = plan_owners(items, 2)
        >>> part = subplan(plan, ["h.1.w", "h.3.w"])
        >>> part.names, [part.owner(n) for n in part.names] == [plan.owner(n) for n in part.names]
        (('h.1.w', 'h.3.w'), True)
    """
    # by the plan's index, in the plan's order: a scan of every item per call made the
    # engines' one call per layer cost layers × items at bind
    keep = sorted({plan.index(n) for n in names if n in plan})
    shapes = shapes or {}
    items = tuple(
        dataclasses.replace(plan.items[k], shape=shapes[plan.items[k].name])
        if plan.items[k].name in shapes
        else plan.items[k]
        for k in keep
    )
    owners = tuple(plan.owners[k] for k in keep)
    units = tuple(
        OwnerUnit(i.name, (i.name,), i.layer, 0.0, o) for i, o in zip(items, owners, strict=True)
    )
    return OwnerPlan(
        items,
        owners,
        units,
        (0.0,) * plan.world_size,
        plan.world_size,
        plan.replicate_size,
        plan.strategy,
        plan.solver,
    )


def unnarrowed_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's ``norm_type``-norm, accumulated in fp32, or in the tensor's own dtype
    where that is wider (float64: ``torch._foreach_norm`` refuses to narrow it): one
    fused call per such dtype, so fp32/bf16/fp16 tensors take the one fp32 call they
    always took. In the tensors' order."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(torch.promote_types(t.dtype, torch.float32), []).append(i)
    out: list[torch.Tensor] = list(tensors)
    for dtype, indices in by_dtype.items():
        norms = torch._foreach_norm([tensors[i] for i in indices], norm_type, dtype=dtype)
        for i, n in zip(indices, norms, strict=True):
            out[i] = n
    return out
