"""Embeddings and output heads: the parameters whose rows are tokens, told by module and name.

An embedding is a lookup and an output head a read-out to the vocabulary: their rows
are tokens, not a linear map to orthogonalise, so Keller Jordan's Muon, Moonlight and
microsoft/dion train them with AdamW. :func:`~dmuon.optim.assignment.param_groups`
asks this module which parameters they are (an ``nn.Embedding``, an ``nn.Linear``
named like a head or mapping to the vocabulary), and :class:`~dmuon.optim.DMuon`
warns, by :func:`warn_embedding_matrices`, when a matrix rule is handed one by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from dmuon.optim.wrapper_names import outermost_name, own_module_name

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_EMBEDDING_ENDINGS = ("emb", "embed", "embeds", "embedding", "embeddings")
DEFAULT_HEAD_NAMES = ("lm_head", "head", "output", "classifier")

ROOT_HEAD_NAMES = ("fc",)
"""Names of an ``nn.Linear`` that is the output head when the model holds it directly:
torchvision's classifiers (ResNet, GoogLeNet, Inception) read out through ``model.fc``;
deeper in the model ``fc`` is a hidden layer (``blocks.0.mlp.fc``)."""


def named_head(module: str, head_names: Sequence[str]) -> bool:
    """Whether module ``module`` (its name in the model) is named like an output head: its
    last name in ``head_names``, or held by the model itself as one of
    :data:`ROOT_HEAD_NAMES` — through the wrappers of a whole model too
    (``torch.compile``'s ``_orig_mod.fc``, DDP's ``module.fc``, PEFT's
    ``base_model.model.fc``: :func:`outermost_name`). A PEFT adapter's part is judged as
    the module it adapts (:func:`own_module_name`: ``classifier.modules_to_save.default``,
    ``lm_head.lora_A.default``)."""
    own = own_module_name(module)
    return own.rpartition(".")[2] in head_names or outermost_name(own) in ROOT_HEAD_NAMES


def vocabulary_head(
    modules: Sequence[tuple[str, nn.Module]], head_names: Sequence[str]
) -> nn.Linear | None:
    """The last ``nn.Linear`` (in module order) that maps to the token vocabulary, when no
    ``nn.Linear`` is named like a head (:func:`named_head`: that one is the head).

    A decoder's read-out ``h → logits`` follows its blocks, so of all the Linears as
    wide as the vocabulary the last one is the head; earlier ones (an MLP whose width
    happens to equal a small vocabulary) are hidden matrices, and so is any Linear inside
    a repeated block (below a numbered module: ``blocks.2.fc``), which a head never is. The
    vocabulary is a token embedding's size: positional embeddings (named ``pos…``,
    ``position…`` or GPT-2's ``wpe``) are as wide as the context, not the vocabulary.
    """
    if any(isinstance(m, nn.Linear) and named_head(n, head_names) for n, m in modules):
        return None

    def positional(name: str) -> bool:
        last = name.rsplit(".", 1)[-1].lower()
        return last.startswith("pos") or "position" in last or last == "wpe"

    vocab_sizes = {
        m.num_embeddings for n, m in modules if isinstance(m, EMBEDDINGS) and not positional(n)
    }
    wide = [
        m
        for n, m in modules
        if isinstance(m, nn.Linear)
        and m.out_features in vocab_sizes
        and not any(part.isdigit() for part in n.split(".")[:-1])  # inside a block
    ]
    return wide[-1] if wide else None


def named_like_embedding(name: str) -> bool:
    """Whether ``name`` (a module's or a parameter's own name, no dots) is named like an
    embedding: one of its ``_``-separated words starts with ``emb`` (``embed_tokens``,
    ``emb``, ``embedding``) or ends with one of ``emb``, ``embed``, ``embedding(s)``
    (``tok_embeddings``, ``posemb``), or it is GPT-2's ``wte``/``wpe``.

    Words, not a substring of the whole name: ``member_table`` or ``remember`` holds
    ``emb`` without being an embedding, and a hidden matrix so named would otherwise be
    sent to AdamW.

    Examples:
        >>> from dmuon.optim.embeddings import named_like_embedding
        >>> [named_like_embedding(n) for n in ("embed_tokens", "tok_embeddings", "wte", "pos_emb")]
        [True, True, True, True]
        >>> named_like_embedding("member_table"), named_like_embedding("remember")
        (False, False)
    """
    words = name.lower().split("_")
    return name.lower() in ("wte", "wpe") or any(
        w.startswith("emb") or w.endswith(_EMBEDDING_ENDINGS) for w in words
    )


def embedding_like(name: str, head_names: Sequence[str] = DEFAULT_HEAD_NAMES) -> bool:
    """Whether parameter ``name`` is named like an embedding or an output head.

    Its module's name (the last component before the parameter's; for a PEFT adapter's
    part, the adapted module's: :func:`~dmuon.optim.wrapper_names.own_module_name`) is one of
    ``head_names`` or :func:`named_like_embedding` (``embed_tokens``, ``tok_embeddings``,
    GPT-2's ``wte``/``wpe``; not ``member_table``). Only names are seen: a parameter handed to
    :class:`~dmuon.optim.DMuon` without one cannot be judged.

    Examples:
        >>> from dmuon.optim.embeddings import embedding_like
        >>> embedding_like("model.embed_tokens.weight"), embedding_like("lm_head.weight")
        (True, True)
        >>> embedding_like("layers.0.mlp.up_proj.weight"), embedding_like("router.remember.weight")
        (False, False)
    """
    module = own_module_name(name.rpartition(".")[0]).rpartition(".")[2]
    return module in head_names or named_like_embedding(module)


def warn_embedding_matrices(groups: Sequence[Mapping[str, Any]], matrix_rules: Any) -> None:
    """Warn (``UserWarning``) when a matrix group holds parameters named like embeddings
    or heads, as ``DMuon(model.named_parameters())`` of a model without biases and norms
    does: Muon is for hidden weight matrices, and :func:`param_groups` sends these to
    AdamW."""
    names = [
        name
        for g in groups
        if g.get("rule") in matrix_rules
        for name in g.get("param_names") or ()
        if embedding_like(name)
    ]
    if names:
        shown = ", ".join(repr(n) for n in names[:4]) + (", …" if len(names) > 4 else "")
        warnings.warn(
            f"DMuon: a matrix rule will update {shown}, named like an embedding or an output "
            "head. Muon is for hidden weight matrices; embeddings and heads train with AdamW: "
            "build the groups with dmuon.optim.param_groups(model), which sends them to AdamW, "
            "or put them in a group with rule='adamw' (to orthogonalise them anyway, choose them "
            "with param_groups(model, matrix=...))",
            UserWarning,
            stacklevel=3,
        )
