"""Forward hooks that record each attention layer's per-head maximum logit.

Three kinds of modules are recognised; anything else is described by the user with an
:class:`~dmuon.optim.qk_heads.AttentionHeads` and its maxima passed to
:meth:`QKClip.record <dmuon.optim.QKClip.record>` (the callback for custom
attention).

* **Hugging Face Llama / Qwen2 / Mistral attention** (recognised by duck typing, no
  import of ``transformers``): a module with ``q_proj`` and ``k_proj`` linear layers,
  ``head_dim``, ``scaling`` and a ``config`` with ``num_attention_heads`` and
  ``num_key_value_heads``, called with ``position_embeddings=(cos, sin)`` and
  ``attention_mask``. The hooks on ``q_proj`` and ``k_proj`` keep their outputs
  (no extra matmul); the module's forward hook applies the rotary embedding
  ``x·cos + rotate_half(x)·sin`` of these models and computes the maxima with
  ``scale = module.scaling``. The mask is the one the model passes: a tensor mask
  (boolean ``True`` = attend, or additive) is applied as given; with none (``sdpa``
  without padding) the logits are causal when ``module.is_causal`` (it is for these
  models). Modules with a QK-norm (``q_norm``/``k_norm``: Qwen3, OLMo2) are refused:
  the norm undoes a scale of ``W_q``, so the clip could not bound their logits.
* **Hugging Face GPT-2 self-attention** (``GPT2Attention``, by duck typing): a
  module with a ``Conv1D`` ``c_attn`` of ``3·embed_dim`` outputs, stored
  ``(embed_dim, 3·embed_dim)`` — the queries, keys and values of every head side by
  side in its columns — and ``num_heads``, ``head_dim``, ``split_size``, ``scaling``
  and ``is_cross_attention``. The hook on ``c_attn`` keeps its output (no extra
  matmul): ``q``, ``k`` are its first two ``embed_dim`` columns, cut into heads as the
  module does; no rotary embedding; ``scale = module.scaling`` (which includes
  ``scale_attn_by_inverse_layer_idx``); the mask as for Llama above. The clip scales
  the query and key *columns* of ``c_attn.weight`` and the matching entries of
  ``c_attn.bias``. Cross-attention (``is_cross_attention``: queries from
  ``q_attn``, keys from the encoder) is refused.
* **``nn.MultiheadAttention``**: the forward hook projects the query and key inputs
  again with the query and key rows of ``in_proj_weight`` (or ``q_proj_weight`` and
  ``k_proj_weight``) and its bias — two extra ``(E × E)`` matmuls per token — and
  uses ``scale = 1/√head_dim``, ``attn_mask`` (boolean ``True`` = masked out, or
  additive), ``key_padding_mask`` and ``is_causal`` as the module does.
  ``add_bias_kv`` and ``add_zero_attn`` are refused.

Recording happens only while autograd is enabled (training forwards and their
recomputation under activation checkpointing; not ``torch.no_grad()`` evaluation),
and maxima accumulate by ``max`` until :meth:`QKClip.step` consumes them, so
gradient-accumulation micro-batches all count.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.optim.attention_logits import allowed_from_mask, head_max_logits
from dmuon.optim.engine.params import is_dtensor
from dmuon.optim.layout_keys import is_conv1d
from dmuon.optim.qk_heads import AttentionHeads, HeadRows

__all__ = ["KINDS", "attention_heads", "attention_kind", "install_hooks"]

#: The attention modules recognised: ``"hf"`` (Llama/Qwen2/Mistral), ``"gpt2"``
#: (GPT-2's fused ``Conv1D`` ``c_attn``) and ``"mha"``.
KINDS = ("hf", "gpt2", "mha")

SUPPORTED = (
    "Hugging Face Llama/Qwen2/Mistral attention, Hugging Face GPT-2 self-attention, "
    "nn.MultiheadAttention"
)

Record = Callable[[str, torch.Tensor], None]


def attention_kind(module: nn.Module) -> str | None:
    """``"hf"``, ``"gpt2"``, ``"mha"`` or ``None`` (not an attention module recognised here)."""
    if isinstance(module, nn.MultiheadAttention):
        return "mha"
    c_attn = getattr(module, "c_attn", None)
    if (
        isinstance(c_attn, nn.Module)
        and is_conv1d(c_attn)
        and all(hasattr(module, a) for a in ("num_heads", "head_dim", "split_size", "scaling"))
        and hasattr(module, "is_cross_attention")
    ):
        return "gpt2"
    config = getattr(module, "config", None)
    if (
        isinstance(getattr(module, "q_proj", None), nn.Linear)
        and isinstance(getattr(module, "k_proj", None), nn.Linear)
        and hasattr(module, "head_dim")
        and hasattr(module, "scaling")
        and hasattr(config, "num_attention_heads")
        and hasattr(config, "num_key_value_heads")
    ):
        return "hf"
    return None


def attention_heads(name: str, module: nn.Module) -> AttentionHeads:
    """The heads of a recognised attention module and the rows that make them.

    Raises:
        TypeError: ``module`` is not a recognised attention module.
        ValueError: a configuration QK-clip cannot bound (QK-norm, ``add_bias_kv``).
    """
    kind = attention_kind(module)
    if kind == "mha":
        assert isinstance(module, nn.MultiheadAttention)
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError(
                f"attention {name!r}: nn.MultiheadAttention with add_bias_kv or add_zero_attn "
                "is not supported (its extra key is not made by the key rows)"
            )
        E, H = module.embed_dim, module.num_heads
        hd = E // H
        b = module.in_proj_bias
        if module.in_proj_weight is not None:
            w = module.in_proj_weight
            parts = (
                HeadRows(w, "query", hd, bias=b, offset=0),
                HeadRows(w, "key", hd, bias=b, offset=E),
            )
        else:
            parts = (
                HeadRows(module.q_proj_weight, "query", hd),
                HeadRows(module.k_proj_weight, "key", hd),
            )
            if b is not None:  # the bias stays packed [q | k | v]
                parts += (HeadRows(b, "query", hd, offset=0), HeadRows(b, "key", hd, offset=E))
        return AttentionHeads(name, H, H, parts)
    if kind == "gpt2":
        return _gpt2_heads(name, module)
    if kind == "hf":
        norms = (getattr(module, "q_norm", None), getattr(module, "k_norm", None))
        if any(n is not None for n in norms):
            raise ValueError(
                f"attention {name!r} ({type(module).__name__}) normalises q and k (q_norm/k_norm): "
                "scaling W_q and W_k does not change its logits, so QK-clip cannot bound them"
            )
        cfg: Any = module.config
        H, Hkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        hd = int(module.head_dim)  # type: ignore[arg-type]
        q: Any = module.q_proj
        k: Any = module.k_proj
        return AttentionHeads(
            name,
            H,
            Hkv,
            (
                HeadRows(q.weight, "query", hd, bias=q.bias),
                HeadRows(k.weight, "key", hd, bias=k.bias),
            ),
        )
    raise TypeError(
        f"module {name!r} of type {type(module).__module__}.{type(module).__qualname__} is not an "
        f"attention module QK-clip recognises ({SUPPORTED}); describe it with AttentionHeads "
        "and record its maxima with QKClip.record"
    )


def _gpt2_heads(name: str, module: nn.Module) -> AttentionHeads:
    """GPT-2's heads: query columns ``[0, E)`` and key columns ``[E, 2E)`` of ``c_attn``."""
    what = f"attention {name!r} ({type(module).__name__})"
    if module.is_cross_attention:
        raise ValueError(
            f"{what} is cross-attention (queries from q_attn, keys and values from c_attn over "
            "the encoder's states), which QK-clip does not support; pass modules=[...] naming "
            "the self-attention modules only"
        )
    m: Any = module
    H, hd, E = int(m.num_heads), int(m.head_dim), int(m.split_size)
    c: Any = module.c_attn
    shape = tuple(c.weight.shape)
    if H * hd != E or shape[1] != 3 * E:
        raise ValueError(
            f"{what}: c_attn.weight of shape {shape} is not (embed_dim, 3·embed_dim) with "
            f"embed_dim = num_heads·head_dim = {H}·{hd} (split_size {E}); QK-clip reads the "
            "queries and keys from its first two embed_dim columns"
        )
    w, b = c.weight, c.bias
    parts = (
        HeadRows(w, "query", hd, bias=b, offset=0, transposed=True),
        HeadRows(w, "key", hd, bias=b, offset=E, transposed=True),
    )
    return AttentionHeads(name, H, H, parts)


def install_hooks(
    name: str, module: nn.Module, heads: AttentionHeads, record: Record, max_elements: int
) -> list[RemovableHandle]:
    """Install the hooks that call ``record(name, maxima)`` after each forward of ``module``."""
    kind = attention_kind(module)
    if kind == "mha":
        return _install_mha(name, module, heads, record, max_elements)
    return _install_hf(name, module, heads, record, max_elements, gpt2=kind == "gpt2")


def _plain(t: torch.Tensor, name: str) -> torch.Tensor:
    if is_dtensor(t):
        raise ValueError(
            f"attention {name!r}: its weights are DTensors during the forward; QK-clip needs "
            "the whole query and key projections there (FSDP2 unshards them; tensor-parallel "
            "attention is not supported)"
        )
    return t


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _install_hf(
    name: str,
    module: nn.Module,
    heads: AttentionHeads,
    record: Record,
    max_elements: int,
    *,
    gpt2: bool = False,
) -> list[RemovableHandle]:
    """Llama-like (``q_proj``, ``k_proj``, rotary) or, with ``gpt2``, GPT-2 (``c_attn``)."""
    state: dict[str, Any] = {}
    hd = int(module.head_dim)  # type: ignore[arg-type]
    E = int(module.split_size) if gpt2 else 0  # type: ignore[arg-type]
    sig = inspect.signature(module.forward)

    def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.clear()
        if not torch.is_grad_enabled():
            return
        bound = sig.bind_partial(*args, **kwargs).arguments
        state["rope"] = bound.get("position_embeddings")
        state["mask"] = bound.get("attention_mask")
        state["on"] = True

    def keep(slot: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def hook(mod: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if state.get("on"):
                state[slot] = output.detach()

        return hook

    def keep_qk(mod: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if state.get("on"):  # q | k | v along the last dimension, as GPT2Attention splits it
            out = output.detach()
            state["q"], state["k"] = out[..., :E], out[..., E : 2 * E]

    def post(mod: nn.Module, args: Any, output: Any) -> None:
        if not state.get("on") or "q" not in state or "k" not in state:
            state.clear()
            return
        q, k = state["q"], state["k"]
        # (b, L, H·d) → (b, H, L, d), as the module's forward does
        q = q.reshape(*q.shape[:-1], -1, hd).transpose(1, 2)
        k = k.reshape(*k.shape[:-1], -1, hd).transpose(1, 2)
        rope = state["rope"]
        if rope is not None:
            cos, sin = rope
            if cos.shape[-1] != hd:
                raise ValueError(
                    f"attention {name!r}: rotary embedding of width {cos.shape[-1]} on heads of "
                    f"dimension {hd} (partial rotary) is not supported"
                )
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        mask = state["mask"]
        allowed = None
        causal = False
        if mask is not None:
            allowed = allowed_from_mask(mask, true_means_attend=True)[..., -k.shape[2] :]
        else:
            causal = bool(getattr(mod, "is_causal", True))
        state.clear()
        scale = float(mod.scaling)  # type: ignore[arg-type]
        maxima = head_max_logits(
            q, k, scale, causal=causal, allowed=allowed, max_elements=max_elements
        )
        record(name, maxima)

    if gpt2:
        keepers = [module.c_attn.register_forward_hook(keep_qk)]  # type: ignore[union-attr]
    else:
        keepers = [
            module.q_proj.register_forward_hook(keep("q")),  # type: ignore[union-attr]
            module.k_proj.register_forward_hook(keep("k")),  # type: ignore[union-attr]
        ]
    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        *keepers,
        module.register_forward_hook(post),
    ]


def _install_mha(
    name: str, module: nn.Module, heads: AttentionHeads, record: Record, max_elements: int
) -> list[RemovableHandle]:
    assert isinstance(module, nn.MultiheadAttention)
    sig = inspect.signature(module.forward)
    E, H = module.embed_dim, module.num_heads
    hd = E // H

    def post(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        a = sig.bind(*args, **kwargs)
        a.apply_defaults()
        query, key = a.arguments["query"], a.arguments["key"]
        with torch.no_grad():
            if query.dim() == 2:  # unbatched (L, E)
                query, key = query.unsqueeze(0), key.unsqueeze(0)
            elif not module.batch_first:  # (L, N, E) → (N, L, E)
                query, key = query.transpose(0, 1), key.transpose(0, 1)
            b: torch.Tensor | None = module.in_proj_bias
            b = None if b is None else _plain(b, name)
            if module.in_proj_weight is not None:
                w = _plain(module.in_proj_weight, name)
                wq, wk = w[:E], w[E : 2 * E]
            else:
                wq = _plain(module.q_proj_weight, name)
                wk = _plain(module.k_proj_weight, name)
            bq = None if b is None else b[:E]
            bk = None if b is None else b[E : 2 * E]
            N, L, S = query.shape[0], query.shape[1], key.shape[1]
            q = F.linear(query, wq, bq).reshape(N, L, H, hd).transpose(1, 2)
            k = F.linear(key, wk, bk).reshape(N, S, H, hd).transpose(1, 2)
            allowed = None
            attn_mask, kpm = a.arguments["attn_mask"], a.arguments["key_padding_mask"]
            if attn_mask is not None:
                am = allowed_from_mask(attn_mask, true_means_attend=False)
                allowed = am.reshape(N, H, L, S) if am.dim() == 3 else am.reshape(1, 1, L, S)
            if kpm is not None:
                kp = allowed_from_mask(kpm, true_means_attend=False).reshape(-1, 1, 1, S)
                allowed = kp if allowed is None else allowed & kp
            causal = bool(a.arguments["is_causal"]) and attn_mask is None
            record(
                name,
                head_max_logits(
                    q, k, hd**-0.5, causal=causal, allowed=allowed, max_elements=max_elements
                ),
            )

    return [module.register_forward_hook(post, with_kwargs=True)]
