"""Which keys of a torchtitan optimizer config DMuon accepts, and the groups it builds.

torchtitan's :class:`~torchtitan.components.optimizer.OptimizersContainer` adds the
implementation keys ``fused`` and ``foreach`` to every parameter group it builds
(``OptimizersContainer._build_impl_kwargs``); DMuon has neither (its matrices are
stepped by its own engine, its scalar parameters by its own AdamW), so they are
dropped here, whatever ``implementation`` says. Every other key must be one DMuon
accepts: a misspelt key would otherwise be silently ignored by torchtitan's logging
and only fail deep inside DMuon's constructor.

``split_sizes`` cuts a fused projection's rows into contiguous blocks (q, then k, then
v). torchtitan's ``FusedQKVLinear`` lays its ``wqkv`` rows out per key/value head
instead (``[n_kv_heads, heads_per_kv + 2, head_dim]``: each group's query heads, its
key, its value), so any contiguous cut would orthogonalise q, k and v rows together as
if they were one projection; :func:`check_fused_qkv_splits` refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = [
    "IMPLEMENTATION_KEYS",
    "OPTIMIZER_NAME",
    "check_constructor_kwargs",
    "check_fused_qkv_splits",
    "strip_implementation_keys",
]

OPTIMIZER_NAME = "DMuon"
"""The ``optimizer_name`` a torchtitan ``ParamGroupConfig`` uses to select DMuon."""

IMPLEMENTATION_KEYS = ("fused", "foreach")
"""Keys torchtitan adds to every group, meaningless to DMuon (dropped)."""

# Keys a container sets itself: the parameters and the layout-dependent choices.
_RESERVED = ("params", "distributed", "process_group", "store")


def check_constructor_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse keys of ``kwargs`` that DMuon's constructor does not take by name.

    Rule options (``beta2`` for NorMuon, …) go through DMuon's ``**rule_options`` and
    are checked by DMuon itself against the chosen rule; here only the keys a
    container must set (``params``, ``distributed``, ``process_group``, ``store``)
    and torchtitan's implementation keys are refused, with ``where`` (the config
    field) named in the error.

    Raises:
        ValueError: a reserved or implementation key, naming it and ``where``.
    """
    for key in kwargs:
        if key in _RESERVED:
            raise ValueError(
                f"{where}: key {key!r} is set by DMuonOptimizersContainer from the model "
                f"parts and their meshes; remove it (keys it sets: {list(_RESERVED)})"
            )
        if key in IMPLEMENTATION_KEYS:
            raise ValueError(
                f"{where}: key {key!r} is a torch.optim implementation switch DMuon does "
                "not have; remove it (torchtitan's own 'implementation' setting is ignored "
                "for DMuon)"
            )


def strip_implementation_keys(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` without the ``fused``/``foreach`` keys torchtitan adds to each."""
    return [{k: v for k, v in g.items() if k not in IMPLEMENTATION_KEYS} for g in groups]


def check_fused_qkv_splits(model: nn.Module, groups: Sequence[Mapping[str, Any]]) -> None:
    """Refuse ``split_sizes`` on the weight of a torchtitan ``FusedQKVLinear``.

    Its rows are interleaved per key/value head (module docstring), so the contiguous
    blocks of ``split_sizes`` mix q, k and v rows: the update would be silently not
    the per-projection one asked for. ``num_heads`` is right there (each block of
    ``head_dim`` rows is one query, key or value head), or no cut (the recipes).
    Same on every rank: the groups and the model's modules are.

    Raises:
        ValueError: naming the parameter, its ``split_sizes`` and what to use instead.
    """
    try:
        from torchtitan.models.common.attention import FusedQKVLinear
    except ImportError:  # a torchtitan without the fused projection: nothing to refuse
        return
    fused: dict[int, tuple[str, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedQKVLinear):
            heads = module.wqkv.weight.shape[0] // module.head_dim
            for pname, p in module.named_parameters():
                fused[id(p)] = (f"{name}.{pname}", heads)
    for group in groups:
        if not group.get("split_sizes"):
            continue
        for p in group["params"]:
            if id(p) in fused:
                name, heads = fused[id(p)]
                raise ValueError(
                    f"split_sizes {tuple(group['split_sizes'])} on {name!r}: torchtitan's "
                    "FusedQKVLinear interleaves its rows per key/value head ([n_kv_heads, "
                    "heads_per_kv + 2, head_dim]), so contiguous blocks would mix q, k and v "
                    "rows; leave it out of split_sizes (orthogonalised whole, as the recipes "
                    f"do), or cut it per head with num_heads={heads} (a param_groups "
                    "group's optimizer_kwargs)"
                )
