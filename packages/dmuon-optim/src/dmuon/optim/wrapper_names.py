"""The name components module wrappers add to the names of a model's parameters.

``torch.compile`` holds the model as ``_orig_mod``, DDP as ``module``, activation
checkpointing's ``CheckpointWrapper`` and FSDP1 as ``_checkpoint_wrapped_module`` and
``_fsdp_wrapped_module``: the same parameter is ``fc.weight`` in the bare model and
``_orig_mod.fc.weight`` or ``module.fc.weight`` in the wrapped one. What compares names
(a loaded state dict's, :func:`~dmuon.optim.param_groups`' root head) leaves them out.
"""

from __future__ import annotations

__all__ = ["WRAPPER_ATTRIBUTES", "WRAPPER_NAMES", "outermost_name"]

WRAPPER_ATTRIBUTES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Attribute names of the modules that wrap another without a name of their own in a
state dict: ``torch.compile``'s ``OptimizedModule``, activation checkpointing's
``CheckpointWrapper`` and FSDP1's wrapper. ``get_model_state_dict`` drops them from the
model's keys (``dmuon.integrations.checkpoint`` from the optimizer state's)."""

WRAPPER_NAMES = WRAPPER_ATTRIBUTES | {"module"}
"""The name components wrappers add to a parameter's name: DDP's ``module.`` and those of
:data:`WRAPPER_ATTRIBUTES`. Left out when a load compares names, so a dict saved from the
bare model loads into the wrapped one, as torch pairs by position."""


def outermost_name(name: str) -> str:
    """``name`` (a module's or a parameter's, dotted) without the leading components that
    wrappers of the whole model add (:data:`WRAPPER_NAMES`): the name in the bare model
    of something the model holds itself.

    Examples:
        >>> outermost_name("_orig_mod.module.fc")
        'fc'
        >>> outermost_name("blocks.0._checkpoint_wrapped_module.fc")  # not leading: kept
        'blocks.0._checkpoint_wrapped_module.fc'
    """
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in WRAPPER_NAMES:
        parts.pop(0)
    return ".".join(parts)
