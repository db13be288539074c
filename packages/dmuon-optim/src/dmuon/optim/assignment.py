"""``param_groups(model)``: which parameters go to the matrix rule and which to AdamW/Lion.

Muon is for the hidden weight matrices of a network. Embeddings and the output
head are lookups/read-outs whose rows are tokens, not a linear map to
orthogonalise; norms, biases and scalars are not matrices at all. The rules below
are those of Keller Jordan's Muon, Moonlight and microsoft/dion, made explicit and
overridable.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Assignment", "ParamGroups", "param_groups"]

_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    nn.RMSNorm,
)
_CONVS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_EMBEDDING_ENDINGS = ("emb", "embed", "embeds", "embedding", "embeddings")
DEFAULT_HEAD_NAMES = ("lm_head", "head", "output", "classifier")

ROOT_HEAD_NAMES = ("fc",)
"""Names of an ``nn.Linear`` that is the output head when the model holds it directly:
torchvision's classifiers (ResNet, GoogLeNet, Inception) read out through ``model.fc``;
deeper in the model ``fc`` is a hidden layer (``blocks.0.mlp.fc``)."""

Predicate = Callable[[str, torch.Tensor], bool]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (GPT-2, GPT, …): a linear layer whose
    ``weight`` is stored ``(in, out)``, the transpose of ``nn.Linear``'s.

    Told by duck typing, without importing ``transformers``: its class is named ``Conv1D``,
    it has an int ``nf`` (the output features) and a 2-D ``weight`` of shape ``(nx, nf)``.
    ``torch.nn.Conv1d`` (lower-case d, a real convolution) is not one.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D
        ...     def __init__(self, nf, nx):
        ...         super().__init__()
        ...         self.nf, self.nx = nf, nx
        ...         self.weight = nn.Parameter(torch.zeros(nx, nf))
        >>> is_conv1d(Conv1D(48, 16)), is_conv1d(nn.Linear(16, 48)), is_conv1d(nn.Conv1d(4, 4, 3))
        (True, False, False)
    """
    if type(module).__name__ != "Conv1D":
        return False
    nf = getattr(module, "nf", None)
    weight = getattr(module, "weight", None)
    return (
        isinstance(nf, int)
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and weight.shape[1] == nf
    )


def _gpt2_qkv_split(
    name: str, module: nn.Module, parents: Mapping[str, nn.Module]
) -> tuple[int, ...] | None:
    """The ``split_sizes`` of GPT-2's fused attention projection ``c_attn``, else ``None``.

    Hugging Face's ``GPT2Attention`` (``transformers.models.gpt2.modeling_gpt2``) holds
    ``c_attn = Conv1D(3 * embed_dim, embed_dim)`` and computes
    ``q, k, v = self.c_attn(x).split(self.split_size, dim=2)`` with ``split_size ==
    embed_dim``; as cross-attention, ``c_attn = Conv1D(2 * embed_dim, embed_dim)`` gives
    ``k, v`` the same way. Its output columns — the rows of the transposed matrix DMuon
    steps — are thus ``split_size``-wide blocks, one per projection. Recognised by the
    parent's class name ending in ``GPT2Attention`` and its int ``split_size``; layout
    checked against transformers 5's source.
    """
    parent_name, _, child = name.rpartition(".")
    parent = parents.get(parent_name)
    if child != "c_attn" or parent is None or not type(parent).__name__.endswith("GPT2Attention"):
        return None
    size = getattr(parent, "split_size", None)
    nf = getattr(module, "nf", 0)
    if not isinstance(size, int) or size <= 0 or nf % size or nf // size not in (2, 3):
        return None
    return (size,) * (nf // size)


@dataclass(frozen=True)
class Assignment:
    """Where one parameter went and why.

    Attributes:
        name: the parameter's name in the model.
        shape: its shape.
        group: the name of its group (``None`` if it was left out).
        reason: the rule that decided it.

    Examples:
        >>> import torch
        >>> from dmuon.optim import param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> a = param_groups(model).assignments[0]
        >>> a.name, a.shape, a.group
        ('0.weight', (16, 8), 'matrix')
    """

    name: str
    shape: tuple[int, ...]
    group: str | None
    reason: str


class ParamGroups(list):
    """The parameter groups of a model (a plain list of dicts) plus where each parameter went.

    Pass it to :class:`~dmuon.optim.DMuon` as is. ``assignments`` lists every
    parameter with its group and the reason; :meth:`summary` formats them.

    Examples:
        >>> import torch
        >>> from dmuon.optim import param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> groups = param_groups(model)
        >>> [(g["name"], len(g["params"])) for g in groups]
        [('matrix', 2), ('scalar: norms, biases and scalars', 2)]
    """

    def __init__(self, groups: Sequence[dict[str, Any]], assignments: Sequence[Assignment]):
        super().__init__(groups)
        self.assignments = list(assignments)

    def summary(self) -> str:
        """A readable table: one line per parameter, then one per group."""
        width = max([len(a.name) for a in self.assignments] + [9])
        lines = [f"{'parameter':<{width}}  {'shape':<18} {'group':<34} reason"]
        for a in self.assignments:
            shape = "x".join(map(str, a.shape)) or "scalar"
            lines.append(f"{a.name:<{width}}  {shape:<18} {a.group or '(left out)':<34} {a.reason}")
        lines.append("")
        for g in self:
            n = sum(p.numel() for p in g["params"])
            algo = g.get("rule", "(the rule)")
            lines.append(f"{g['name']}: {len(g['params'])} tensors, {n:,} elements, {algo}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _match(patterns: Mapping[str, Any] | None, name: str) -> Any:
    if not patterns:
        return None
    for pattern, value in patterns.items():
        if re.search(pattern, name):
            return value
    return None


def _named_head(module: str, head_names: Sequence[str]) -> bool:
    """Whether module ``module`` (its name in the model) is named like an output head: its
    last name in ``head_names``, or held by the model itself as one of
    :data:`ROOT_HEAD_NAMES`."""
    return module.rpartition(".")[2] in head_names or module in ROOT_HEAD_NAMES


def _vocabulary_head(
    modules: Sequence[tuple[str, nn.Module]], head_names: Sequence[str]
) -> nn.Linear | None:
    """The last ``nn.Linear`` (in module order) that maps to the token vocabulary, when no
    ``nn.Linear`` is named like a head (:func:`_named_head`: that one is the head).

    A decoder's read-out ``h → logits`` follows its blocks, so of all the Linears as
    wide as the vocabulary the last one is the head; earlier ones (an MLP whose width
    happens to equal a small vocabulary) are hidden matrices, and so is any Linear inside
    a repeated block (below a numbered module: ``blocks.2.fc``), which a head never is. The
    vocabulary is a token embedding's size: positional embeddings (named ``pos…``,
    ``position…`` or GPT-2's ``wpe``) are as wide as the context, not the vocabulary.
    """
    if any(isinstance(m, nn.Linear) and _named_head(n, head_names) for n, m in modules):
        return None

    def positional(name: str) -> bool:
        last = name.rsplit(".", 1)[-1].lower()
        return last.startswith("pos") or "position" in last or last == "wpe"

    vocab_sizes = {
        m.num_embeddings for n, m in modules if isinstance(m, _EMBEDDINGS) and not positional(n)
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
        >>> from dmuon.optim.assignment import named_like_embedding
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

    Its module's name (the last component before the parameter's) is one of
    ``head_names`` or :func:`named_like_embedding` (``embed_tokens``, ``tok_embeddings``,
    GPT-2's ``wte``/``wpe``; not ``member_table``). Only names are seen: a parameter handed to
    :class:`~dmuon.optim.DMuon` without one cannot be judged.

    Examples:
        >>> from dmuon.optim.assignment import embedding_like
        >>> embedding_like("model.embed_tokens.weight"), embedding_like("lm_head.weight")
        (True, True)
        >>> embedding_like("layers.0.mlp.up_proj.weight"), embedding_like("router.remember.weight")
        (False, False)
    """
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
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


_PLAIN = "2-D hidden weight"


def _matrix_group(
    name: str,
    p: torch.Tensor,
    mods: Sequence[tuple[str, nn.Module]],
    by_name: Mapping[str, nn.Module],
    split_sizes: Mapping[str, Sequence[int]] | None,
    num_heads: Mapping[str, int | Sequence[int]] | None,
    forced: bool,
) -> tuple[Any, dict[str, Any], str]:
    """The matrix group of parameter ``name`` (held as ``mods``: ``(full name, module)``
    pairs): ``(key, extra group keys, reason)``, the key's first item the group's name —
    decisions 7 to 9 of :func:`param_groups`.

    One function for the parameters the ``matrix`` predicate forces and for the others, so
    that a forced parameter is laid out and cut (``split_sizes``, ``num_heads``, the q|k|v
    split of ``nn.MultiheadAttention`` and GPT-2's ``c_attn``) as it would be unforced:
    the predicate chooses the side, not how the rule sees the matrix. Unforced, a 2-D
    ``nn.Parameter`` named like an embedding gives the key ``None`` (the scalar side).
    """
    local = [(n.rsplit(".", 1)[-1], m) for n, m in mods]
    is_weight_of = [m for (pn, m) in local if pn == "weight"]
    convs = [m for m in is_weight_of if isinstance(m, _CONVS)]
    conv1d = [(n, m) for (n, m) in mods if n.rsplit(".", 1)[-1] == "weight" and is_conv1d(m)]
    if p.ndim < 2:  # only when forced: DMuon refuses it, naming the parameter
        return ("matrix",), {}, f"{p.ndim}-D"
    if convs and p.ndim > 2:
        if isinstance(convs[0], _CONV_TRANSPOSES) and convs[0].groups == 1:
            return (
                ("matrix: conv transpose", True, True),
                {"flatten": True, "transposed": True},
                "ConvTranspose weight (in, out, *kernel), stepped as one flattened matrix "
                "(out, in·kernel)",
            )
        if isinstance(convs[0], _CONV_TRANSPOSES):
            # (in, out/groups, *kernel): dims 0 and 1 swapped would mix the groups' output
            # channels in one row, so it is flattened as stored, the input channels as rows
            return (
                ("matrix: conv", True),
                {"flatten": True},
                "ConvTranspose weight (in, out/groups, *kernel), groups > 1: one flattened "
                "matrix (in, out/groups·kernel), rows the input channels",
            )
        return (
            ("matrix: conv", True),
            {"flatten": True},
            "conv weight, one flattened matrix (out, in·kernel)",
        )
    sizes = _match(split_sizes, name)
    heads_n = _match(num_heads, name)
    heads_v = heads_n if isinstance(heads_n, int) or heads_n is None else tuple(heads_n)
    if conv1d and p.ndim == 2:
        mod_name = conv1d[0][0].rsplit(".", 1)[0]
        gpt2 = None if sizes is not None else _gpt2_qkv_split(mod_name, conv1d[0][1], by_name)
        sizes = gpt2 if sizes is None else sizes
        extra: dict[str, Any] = {"transposed": True}
        label = "matrix: Conv1D (in, out)"
        if sizes is not None:
            extra["split_sizes"] = tuple(sizes)
            label += f" {tuple(sizes)}"
        if heads_v is not None:
            extra["num_heads"] = heads_v
            label += f" {heads_v}"
        reason = "Conv1D weight (in, out), stepped as its transpose (out, in)" + (
            ", q|k|v split (GPT-2 c_attn)"
            if gpt2 is not None
            else ", cut by split_sizes/num_heads"
            if len(extra) > 1
            else ""
        )
        return (label, True), extra, reason
    if p.ndim == 2:
        mha = [
            m
            for (pn, m) in local
            if pn == "in_proj_weight" and isinstance(m, nn.MultiheadAttention)
        ]
        linear = any(isinstance(m, nn.Linear) for m in is_weight_of)
        if sizes is None and mha:
            e = mha[0].embed_dim
            sizes = (e, e, e)
        own_names = name.split(".")[-2:]  # the parameter's own name and its module's
        if (
            not forced
            and sizes is None
            and heads_v is None
            and not linear
            and not mha
            and any(named_like_embedding(n) for n in own_names)
        ):
            return None, {}, "2-D parameter named like an embedding"
        if sizes is None and heads_v is None:
            return ("matrix",), {}, _PLAIN
        sizes_t = tuple(sizes) if sizes is not None else None
        label = "matrix: fused" if sizes_t else "matrix: per-head"
        extra = {}
        if sizes_t is not None:
            extra["split_sizes"] = sizes_t
        if heads_v is not None:
            extra["num_heads"] = heads_v
        reason = "fused QKV (nn.MultiheadAttention)" if mha else "split_sizes/num_heads"
        return (f"{label} {sizes_t or ''} {heads_v or ''}".strip(),), extra, reason
    extra = {"flatten": False}
    if sizes is not None:
        extra["split_sizes"] = tuple(sizes)
    if heads_v is not None:
        extra["num_heads"] = heads_v
    label = "matrix: stacks"
    if len(extra) > 1:
        label += f" {extra.get('split_sizes') or ''} {extra.get('num_heads') or ''}"
    reason = f"{p.ndim}-D stack of matrices (last two dims)" + (
        ", each cut by split_sizes/num_heads" if len(extra) > 1 else ""
    )
    return (label.strip(), False), extra, reason


def param_groups(
    model: nn.Module,
    *,
    matrix: Predicate | None = None,
    scalar: Predicate | None = None,
    split_sizes: Mapping[str, Sequence[int]] | None = None,
    num_heads: Mapping[str, int | Sequence[int]] | None = None,
    head_names: Sequence[str] = DEFAULT_HEAD_NAMES,
    include_frozen: bool = False,
    decay_norms_and_biases: bool = False,
    verbose: bool = False,
) -> ParamGroups:
    """Build DMuon's parameter groups for ``model``.

    Decisions, in order (the first that applies wins):

    1. Frozen parameters (``requires_grad=False``) are left out unless
       ``include_frozen``.
    2. ``scalar(name, p)`` / ``matrix(name, p)`` predicates, when given, force a side.
       They skip decisions 3 to 6 only: a parameter the ``matrix`` predicate forces is
       laid out and cut by 7 to 9 as it would be unforced (its ``split_sizes`` and
       ``num_heads``, the q|k|v split of ``nn.MultiheadAttention`` and GPT-2's
       ``c_attn``), since the predicate says which side, not what the matrix is.
    3. 0-D and 1-D parameters (biases, norm gains, scalars) → scalar optimizer.
    4. Embedding weights (``nn.Embedding``/``EmbeddingBag``), and an output head
       tied to one → scalar optimizer.
    5. The output head → scalar optimizer: an ``nn.Linear`` whose module name is in
       ``head_names`` (or, held by the model itself, in :data:`ROOT_HEAD_NAMES`:
       torchvision's ``model.fc``), or else (no ``nn.Linear`` so named) the *last* ``nn.Linear`` in
       module order, outside the numbered blocks, whose ``out_features`` equals a
       token embedding's vocabulary size (the read-out to the vocabulary comes after
       the blocks; an inner ``Linear`` that merely happens to be as wide as the
       vocabulary, or as a positional embedding's context, stays a hidden matrix).
    6. Any parameter of a norm layer → scalar optimizer.
    7. Convolution weights → matrix rule with ``flatten=True``: each is one
       ``(out, in·kernel)`` matrix, flattened per parameter, never across.
       ``nn.ConvTranspose1d/2d/3d`` weights are stored ``(in, out, *kernel)``: with
       ``groups=1`` they also get ``transposed=True`` and are stepped as ``(out,
       in·kernel)``, rows the output channels (a stride-1 transposed convolution is
       the convolution of weight ``w.transpose(0, 1)``, kernel flipped, and trains as
       it); with ``groups > 1`` they are flattened as stored, ``(in,
       out/groups·kernel)``, rows the input channels (swapping dims 0 and 1 would put
       the output channels of different groups in one row). Hugging
       Face's ``Conv1D`` weights (GPT-2; stored ``(in, out)``, the transpose of
       ``nn.Linear``'s; told without importing ``transformers``, see :func:`is_conv1d`)
       → matrix rule with ``transposed=True``: each is stepped as its ``(out, in)``
       transpose, so row statistics, ``adjust_lr`` and ``split_sizes``/``num_heads``
       act on its output neurons. GPT-2's fused ``attn.c_attn`` (q|k|v along its
       columns) gets ``split_sizes=(E, E, E)`` (``(E, E)``, k|v, in cross-attention),
       unless ``split_sizes`` names it.
    8. 2-D weights → matrix rule. ``nn.MultiheadAttention.in_proj_weight`` gets
       ``split_sizes=(E, E, E)`` (q, k, v orthogonalised separately); names matching a
       regular expression of ``split_sizes`` / ``num_heads`` get those. A 2-D
       ``nn.Parameter`` held directly by a module (not a Linear), with neither, whose own
       name or module's name is :func:`named_like_embedding` (a word starting with
       ``emb`` or ending in ``emb``/``embed``/``embedding(s)``, or ``wte``/``wpe``:
       ``pos_emb``, ``embeddings.position``; not ``router.member_table``) → scalar
       optimizer.
    9. Parameters with more than 2 dims that are not conv weights (MoE expert stacks
       ``(E, m, n)``) → matrix rule with ``flatten=False``: a batch of matrices; names
       matching ``split_sizes`` / ``num_heads`` cut each matrix's rows as in 8 (e.g.
       Hugging Face's fused ``gate_up_proj`` ``(E, 2I, H)``: ``{r"gate_up_proj$": (I, I)}``
       orthogonalises gate and up separately).

    Groups: one matrix group per distinct (``flatten``, ``transposed``, ``split_sizes``,
    ``num_heads``); a scalar group for embeddings and heads; a scalar group for
    norms, biases and scalars with ``weight_decay=0.0`` (unless
    ``decay_norms_and_biases``). Matrix groups name no ``"rule"`` (they take
    DMuon's ``rule``); scalar groups say ``rule="scalar"`` (DMuon's
    ``scalar_optimizer``). Every group has ``param_names`` and a ``name``.

    Args:
        model: the model.
        matrix: predicate ``(name, param) → bool`` forcing the matrix rule.
        scalar: predicate forcing the scalar optimizer.
        split_sizes: ``{regex: sizes}`` for fused projections, e.g.
            ``{r"attn\\.qkv\\.weight$": (d, d_kv, d_kv)}``.
        num_heads: ``{regex: heads}`` for per-head orthogonalisation.
        head_names: module names that mark an output head.
        include_frozen: keep parameters with ``requires_grad=False``.
        decay_norms_and_biases: let norms/biases take the scalar weight decay.
        verbose: print :meth:`ParamGroups.summary`.

    Returns:
        The groups, with ``.assignments`` and ``.summary()``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (e.g. ``model.parameters()``).
        ValueError: both predicates claim a parameter.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 64), nn.LayerNorm(64),
        ...                       nn.Linear(64, 100))
        >>> groups = param_groups(model)
        >>> [(g["name"], g["param_names"]) for g in groups]  # doctest: +NORMALIZE_WHITESPACE
        [('matrix', ['1.weight']), ('scalar: embeddings and head', ['0.weight', '3.weight']),
         ('scalar: norms, biases and scalars', ['1.bias', '2.weight', '2.bias', '3.bias'])]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"param_groups takes the model (an nn.Module), got {type(model).__name__}: call "
            "param_groups(model), not param_groups(model.parameters()); it needs the modules "
            "to tell embeddings, heads and norms from hidden matrices"
        )
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    order: list[tuple[str, torch.Tensor]] = []
    modules = list(model.named_modules(remove_duplicate=False))
    by_name = dict(modules)
    vocab_head = _vocabulary_head(modules, head_names)
    for mod_name, module in modules:
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) not in owners:
                owners[id(p)] = []
                order.append((full, p))
            owners[id(p)].append((full, module))

    specs: dict[tuple[Any, ...], dict[str, Any]] = {}
    assignments: list[Assignment] = []

    def put(key: tuple[Any, ...], extra: dict[str, Any], name: str, p: torch.Tensor) -> str:
        if key not in specs:
            specs[key] = {"params": [], "param_names": [], "name": key[0], **extra}
        specs[key]["params"].append(p)
        specs[key]["param_names"].append(name)
        return str(key[0])

    scalar_decay = {} if decay_norms_and_biases else {"weight_decay": 0.0}
    for name, p in order:
        mods = owners[id(p)]
        shape = tuple(p.shape)
        if not p.requires_grad and not include_frozen:
            assignments.append(Assignment(name, shape, None, "frozen (requires_grad=False)"))
            continue
        force_scalar = scalar is not None and scalar(name, p)
        force_matrix = matrix is not None and matrix(name, p)
        if force_scalar and force_matrix:
            raise ValueError(f"both the matrix and the scalar predicate claim parameter {name!r}")
        emb = [
            m for (n, m) in mods if n.rsplit(".", 1)[-1] == "weight" and isinstance(m, _EMBEDDINGS)
        ]
        heads = [
            m
            for (n, m) in mods
            if isinstance(m, nn.Linear)
            and n.rsplit(".", 1)[-1] == "weight"
            and (_named_head(n.rpartition(".")[0], head_names) or m is vocab_head)
        ]
        scalar_key = ("scalar: embeddings and head",)
        small_key = ("scalar: norms, biases and scalars",)
        if force_scalar:
            group = put(scalar_key, {"rule": "scalar"}, name, p)
            reason = "scalar predicate"
        elif force_matrix:
            # the predicate skips the embedding, head and norm decisions only: the matrix
            # is cut (split_sizes, num_heads, q|k|v) and laid out as any other
            key, extra, how = _matrix_group(name, p, mods, by_name, split_sizes, num_heads, True)
            group = put(key, extra, name, p)
            reason = "matrix predicate" + ("" if how == _PLAIN else f"; {how}")
        elif p.ndim < 2:
            what = (
                "bias"
                if name.endswith("bias")
                else "norm"
                if any(isinstance(m, _NORMS) for _, m in mods)
                else f"{p.ndim}-D"
            )
            group = put(small_key, {"rule": "scalar", **scalar_decay}, name, p)
            reason = f"{what} parameter"
        elif emb:
            group = put(scalar_key, {"rule": "scalar"}, name, p)
            reason = "embedding" + (" (tied with the output head)" if len(mods) > 1 else "")
        elif heads:
            group = put(scalar_key, {"rule": "scalar"}, name, p)
            reason = "output head"
        elif any(isinstance(m, _NORMS) for _, m in mods):
            group = put(small_key, {"rule": "scalar", **scalar_decay}, name, p)
            reason = "norm parameter"
        else:
            key, extra, reason = _matrix_group(
                name, p, mods, by_name, split_sizes, num_heads, False
            )
            if key is None:
                group = put(scalar_key, {"rule": "scalar"}, name, p)
            else:
                group = put(key, extra, name, p)
        assignments.append(Assignment(name, shape, group, reason))

    groups = sorted(specs.values(), key=lambda g: (g.get("rule") == "scalar", g["name"]))
    result = ParamGroups(groups, assignments)
    if verbose:
        print(result.summary())
    return result
