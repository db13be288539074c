"""``param_groups(model)``: which parameters go to the matrix rule and which to AdamW/Lion.

Muon is for the hidden weight matrices of a network. Embeddings and the output
head are lookups/read-outs whose rows are tokens, not a linear map to
orthogonalise; norms, biases and scalars are not matrices at all. The rules below
are those of Keller Jordan's Muon, Moonlight and microsoft/dion, made explicit and
overridable. Which parameters are embeddings or heads is
:mod:`dmuon.optim.embeddings`'s to tell, and how a matrix is laid out (convolutions,
``Conv1D``, fused q|k|v, stacks) :mod:`dmuon.optim.layout_keys`'; their names stay
importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dmuon.optim.embeddings import DEFAULT_HEAD_NAMES, EMBEDDINGS, named_head, vocabulary_head

# moved to embeddings.py and layout_keys.py, still importable from here (and from the
# deprecated dmuon.optim.groups, which re-exports this module)
from dmuon.optim.embeddings import ROOT_HEAD_NAMES as ROOT_HEAD_NAMES
from dmuon.optim.embeddings import embedding_like as embedding_like
from dmuon.optim.embeddings import named_like_embedding as named_like_embedding
from dmuon.optim.embeddings import warn_embedding_matrices as warn_embedding_matrices
from dmuon.optim.layout_keys import PLAIN, check_layout_patterns, matrix_group
from dmuon.optim.layout_keys import is_conv1d as is_conv1d

__all__ = ["Assignment", "ParamGroups", "param_groups"]

_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    nn.RMSNorm,
)

Predicate = Callable[[str, torch.Tensor], bool]


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
            ``{r"attn\\.qkv\\.weight$": (d, d_kv, d_kv)}`` (``re.search`` over the full
            parameter name; a pattern that matches no parameter warns).
        num_heads: ``{regex: heads}`` for per-head orthogonalisation (likewise).
        head_names: module names that mark an output head.
        include_frozen: keep parameters with ``requires_grad=False``.
        decay_norms_and_biases: let norms/biases take the scalar weight decay.
        verbose: print :meth:`ParamGroups.summary`.

    Returns:
        The groups, with ``.assignments`` and ``.summary()``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (e.g. ``model.parameters()``);
            ``split_sizes`` or ``num_heads`` not a mapping of patterns to values.
        ValueError: both predicates claim a parameter; a pattern that does not compile.

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
    vocab_head = vocabulary_head(modules, head_names)
    for mod_name, module in modules:
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) not in owners:
                owners[id(p)] = []
                order.append((full, p))
            owners[id(p)].append((full, module))

    check_layout_patterns(split_sizes, num_heads, [name for name, _ in order])
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
            m for (n, m) in mods if n.rsplit(".", 1)[-1] == "weight" and isinstance(m, EMBEDDINGS)
        ]
        heads = [
            m
            for (n, m) in mods
            if isinstance(m, nn.Linear)
            and n.rsplit(".", 1)[-1] == "weight"
            and (named_head(n.rpartition(".")[0], head_names) or m is vocab_head)
        ]
        scalar_key = ("scalar: embeddings and head",)
        small_key = ("scalar: norms, biases and scalars",)
        if force_scalar:
            group = put(scalar_key, {"rule": "scalar"}, name, p)
            reason = "scalar predicate"
        elif force_matrix:
            # the predicate skips the embedding, head and norm decisions only: the matrix
            # is cut (split_sizes, num_heads, q|k|v) and laid out as any other
            key, extra, how = matrix_group(name, p, mods, by_name, split_sizes, num_heads, True)
            group = put(key, extra, name, p)
            reason = "matrix predicate" + ("" if how == PLAIN else f"; {how}")
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
            key, extra, reason = matrix_group(name, p, mods, by_name, split_sizes, num_heads, False)
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
