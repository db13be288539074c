"""The layout keys a matrix parameter's group gets from the module that holds it.

:func:`~dmuon.optim.assignment.param_groups` sends a parameter to the matrix side; this
module says how the rule sees it, in the group keys :mod:`dmuon.optim.layout` reads:
``flatten`` for convolution weights (one ``(out, in·kernel)`` matrix each) and
``nn.ConvTranspose`` weights (stored ``(in, out, *kernel)``, so ``transposed`` too where
``groups=1``), ``transposed`` for Hugging Face's ``Conv1D`` (GPT-2's ``(in, out)``
weights, :func:`is_conv1d`), ``split_sizes`` for a fused q|k|v projection
(``nn.MultiheadAttention``'s ``in_proj_weight``, GPT-2's ``c_attn`` as transformers'
``GPT2Attention`` splits it) or a caller's regular expression, ``num_heads`` for
per-head orthogonalisation, and ``flatten=False`` for stacks of matrices (MoE experts).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dmuon.optim.embeddings import named_like_embedding
from dmuon.optim.wrapper_names import own_module_name

_CONVS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


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


def check_layout_patterns(split_sizes: object, num_heads: object, names: Sequence[str]) -> None:
    """Check ``param_groups``' ``split_sizes`` and ``num_heads`` against the parameter
    ``names``: each a mapping ``{regex: value}`` (or ``None``) whose patterns compile, with
    ``split_sizes`` values sequences of sizes and ``num_heads`` values an int or a sequence
    of ints.

    A pattern that matches no parameter name gets a warning naming it and a few names: a
    typo (``attn\\.qkv`` for a module called ``0.qkv``) left a fused q|k|v projection
    orthogonalised as one matrix, silently. A warning, not an error: one set of patterns
    may legitimately serve several model parts (torchtitan builds the groups of each
    pipeline stage with one config, and a stage may hold no attention).

    Raises:
        TypeError: a value that is not a mapping, a pattern that is not a string, or a
            value of the wrong kind (``split_sizes=[16, 16, 16]``: the sizes without the
            pattern they apply to).
        ValueError: a pattern that is not a regular expression.
    """
    for arg, patterns, want in (
        ("split_sizes", split_sizes, "a sequence of sizes, e.g. (d, d_kv, d_kv)"),
        ("num_heads", num_heads, "an int or a sequence of ints"),
    ):
        if patterns is None:
            continue
        if not isinstance(patterns, Mapping):
            raise TypeError(
                f"{arg} must be a mapping {{regex: value}} over parameter names, value "
                f"{want} (e.g. {arg}={{r'attn\\.qkv\\.weight$': "
                f"{'(d, d_kv, d_kv)' if arg == 'split_sizes' else 'n_heads'}}}), got "
                f"{type(patterns).__name__}: {patterns!r}"
            )
        unmatched = []
        for pattern, value in patterns.items():
            if not isinstance(pattern, str):
                raise TypeError(
                    f"{arg}: patterns must be strings (regular expressions over parameter "
                    f"names), got {type(pattern).__name__}: {pattern!r}"
                )
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{arg}: {pattern!r} is not a regular expression ({e})") from None
            if arg == "split_sizes":
                bad = isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable)
            else:
                bad = isinstance(value, bool) or not (
                    isinstance(value, int)
                    or (
                        isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))
                    )
                )
            if bad:
                raise TypeError(f"{arg}[{pattern!r}] must be {want}, got {value!r}")
            if not any(compiled.search(n) for n in names):
                unmatched.append(pattern)
        if unmatched:
            warnings.warn(
                f"param_groups({arg}=...): pattern(s) {unmatched} match no parameter name, so "
                f"they cut nothing; the names look like {list(names[:4])}"
                + (f" (… {len(names)} in all)" if len(names) > 4 else "")
                + ". Check the pattern (re.search over the full dotted name)",
                UserWarning,
                stacklevel=3,
            )


def _match(patterns: Mapping[str, Any] | None, name: str) -> Any:
    if not patterns:
        return None
    for pattern, value in patterns.items():
        if re.search(pattern, name):
            return value
    return None


PLAIN = "2-D hidden weight"
"""The reason :func:`matrix_group` gives a plain 2-D hidden weight (no layout key);
:func:`~dmuon.optim.assignment.param_groups` adds no other to a forced one's."""


def matrix_group(
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
        # the parameter's own name and its module's (a PEFT adapter's part: the adapted
        # module's, own_module_name: embed_tokens' trainable tokens are embedding rows)
        module = own_module_name(name.rpartition(".")[0])
        own_names = [name.rpartition(".")[2], module.rpartition(".")[2]]
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
            return ("matrix",), {}, PLAIN
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
