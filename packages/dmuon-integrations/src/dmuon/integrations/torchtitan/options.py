"""Which keys of a torchtitan optimizer config DMuon accepts, and the groups it builds.

torchtitan's :class:`~torchtitan.components.optimizer.OptimizersContainer` adds the
implementation keys ``fused`` and ``foreach`` to every parameter group it builds
(``OptimizersContainer._build_impl_kwargs``); DMuon has neither (its matrices are
stepped by its own engine, its scalar parameters by its own AdamW), so they are
dropped here, whatever ``implementation`` says. Every other key must be one DMuon
accepts: a misspelt key would otherwise be silently ignored by torchtitan's logging
and only fail deep inside DMuon's constructor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "IMPLEMENTATION_KEYS",
    "OPTIMIZER_NAME",
    "check_constructor_kwargs",
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
