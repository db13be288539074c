"""The name components module wrappers add to the names of a model's parameters.

``torch.compile`` holds the model as ``_orig_mod``, DDP as ``module``, activation
checkpointing's ``CheckpointWrapper`` and FSDP1 as ``_checkpoint_wrapped_module`` and
``_fsdp_wrapped_module``: the same parameter is ``fc.weight`` in the bare model and
``_orig_mod.fc.weight`` or ``module.fc.weight`` in the wrapped one. What compares names
(a loaded state dict's, :func:`~dmuon.optim.param_groups`' root head) leaves them out.

PEFT (Hugging Face's parameter-efficient fine-tuning) wraps twice: the whole model, as
``base_model.model``, and each adapted module, whose trainable parts sit below it —
LoRA's factors ``q_proj.lora_A.default`` / ``lora_B.default`` beside the frozen
``q_proj.base_layer``, and ``modules_to_save``'s trainable copy
``classifier.modules_to_save.default`` beside the frozen ``original_module``.
:func:`own_module_name` gives the adapted module's name, so that a classifier head's
trainable copy, or the LoRA factors of ``lm_head``, are judged as the head they adapt.
"""

from __future__ import annotations

__all__ = [
    "ADAPTER_HOLDERS",
    "PARAMETER_HOLDERS",
    "WRAPPED_LAYERS",
    "WRAPPER_ATTRIBUTES",
    "WRAPPER_NAMES",
    "outermost_name",
    "own_module_name",
]

WRAPPER_ATTRIBUTES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Attribute names of the modules that wrap another without a name of their own in a
state dict: ``torch.compile``'s ``OptimizedModule``, activation checkpointing's
``CheckpointWrapper`` and FSDP1's wrapper. ``get_model_state_dict`` drops them from the
model's keys (``dmuon.integrations.checkpoint`` from the optimizer state's)."""

WRAPPER_NAMES = WRAPPER_ATTRIBUTES | {"module"}
"""The name components wrappers add to a parameter's name: DDP's ``module.`` and those of
:data:`WRAPPER_ATTRIBUTES`. Left out when a load compares names, so a dict saved from the
bare model loads into the wrapped one, as torch pairs by position."""


PEFT_MODEL_PREFIX = ("base_model", "model")
"""The leading components PEFT's ``PeftModel`` adds: its ``base_model`` (the tuner, e.g.
``LoraModel``) holds the model as ``model``."""

ADAPTER_HOLDERS = frozenset({"modules_to_save", "lora_A", "lora_B"})
"""PEFT's containers (``ModuleDict``) of an adapted module's trainable modules, one entry
per adapter name (``q_proj.lora_A.default``)."""

PARAMETER_HOLDERS = frozenset({"lora_embedding_A", "lora_embedding_B", "trainable_tokens_delta"})
"""PEFT's containers (``ParameterDict``) of an adapted module's trainable parameters, one
per adapter name (``embed_tokens.lora_embedding_A.default``, the trainable tokens'
``embed_tokens.token_adapter.trainable_tokens_delta.default``)."""

WRAPPED_LAYERS = frozenset({"base_layer", "original_module", "token_adapter"})
"""PEFT's modules inside an adapted module: the frozen module it adapts, and the trainable
tokens' adapter."""


def own_module_name(name: str) -> str:
    """The name of the model's own module that module ``name`` is, or is an adapter's part
    of (:data:`ADAPTER_HOLDERS`, :data:`PARAMETER_HOLDERS`, :data:`WRAPPED_LAYERS`): PEFT's
    trainable copy, LoRA factors or frozen original of ``classifier`` are judged as
    ``classifier``.

    Examples:
        >>> own_module_name("base_model.model.classifier.modules_to_save.default")
        'base_model.model.classifier'
        >>> own_module_name("lm_head.lora_B.default"), own_module_name("q_proj.base_layer")
        ('lm_head', 'q_proj')
        >>> own_module_name("embed_tokens.token_adapter.trainable_tokens_delta")
        'embed_tokens'
        >>> own_module_name("blocks.0.mlp.fc")
        'blocks.0.mlp.fc'
    """
    parts = name.split(".")
    while True:
        if len(parts) >= 3 and parts[-2] in ADAPTER_HOLDERS:
            parts = parts[:-2]
        elif len(parts) >= 2 and parts[-1] in PARAMETER_HOLDERS | WRAPPED_LAYERS:
            parts = parts[:-1]
        else:
            return ".".join(parts)


def outermost_name(name: str) -> str:
    """``name`` (a module's or a parameter's, dotted) without the leading components that
    wrappers of the whole model add (:data:`WRAPPER_NAMES`, PEFT's
    :data:`PEFT_MODEL_PREFIX`): the name in the bare model of something the model holds
    itself.

    Examples:
        >>> outermost_name("_orig_mod.module.fc"), outermost_name("base_model.model.fc")
        ('fc', 'fc')
        >>> outermost_name("blocks.0._checkpoint_wrapped_module.fc")  # not leading: kept
        'blocks.0._checkpoint_wrapped_module.fc'
    """
    parts = name.split(".")
    while len(parts) > 1:
        if parts[0] in WRAPPER_NAMES:
            parts = parts[1:]
        elif len(parts) > 2 and tuple(parts[:2]) == PEFT_MODEL_PREFIX:
            parts = parts[2:]
        else:
            break
    return ".".join(parts)
