"""Model configurations → the matrices Muon orthogonalises and the scalar parameters.

Three sources, one result (:class:`ModelSpec`):

* a Hugging Face ``config.json`` (Llama, Mistral, Qwen2/2.5, Qwen3, GPT-2, Mixtral,
  Qwen2-MoE, Qwen3-MoE), read with the standard ``json`` module — ``transformers`` is
  not needed. Parameter names follow the Hugging Face modules
  (``model.layers.3.self_attn.q_proj.weight``) so that the layer keys, and hence the
  owner plan, are those :func:`dmuon.optim.param_groups` gives on the real model;
* a named preset (:data:`PRESETS`, the same fields as the published configs);
* ``module:factory``, a Python function that builds an ``nn.Module``; it is built on
  the ``meta`` device (no memory) and split by :func:`dmuon.optim.param_groups`.

What is a Muon matrix follows :func:`~dmuon.optim.param_groups`: 2-D weights of the
blocks and expert stacks ``(E, m, n)`` are; embeddings, the output head, norms and
biases go to the scalar optimizer (AdamW).

Mixture-of-experts layers are written as expert *stacks* ``(E, m, n)`` (one item,
orthogonalised as a batch, as the fused expert weights of recent ``transformers``
releases store them); the parameter count is the same as per-expert matrices.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dmuon.comm import MatrixItem, layer_key

__all__ = ["PRESETS", "ConfigError", "ModelSpec", "load_model", "spec_from_hf_config"]


class ConfigError(ValueError):
    """A model configuration the planner cannot read; the message names the field."""


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model.

    Attributes:
        name: a label (preset name, file name or factory).
        matrices: the Muon matrices as :class:`~dmuon.comm.MatrixItem` (shape as
            orthogonalised, dtype of the parameter, layer key).
        scalars: ``(name, numel)`` of every parameter the scalar optimizer steps.
        active_fraction: of the matrix parameters, the share a token passes through
            (1 for dense models; for MoE, ``k/E`` of the expert stacks), for
            ``6·active·tokens``.
        source: where the description came from.
        heads: attention heads (0: unknown, e.g. a ``module:factory`` model).
        kv_heads: key/value heads (0: unknown); tensor parallelism splits both.
    """

    name: str
    matrices: tuple[MatrixItem, ...]
    scalars: tuple[tuple[str, int], ...]
    active_params: int
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    heads: int = 0
    kv_heads: int = 0

    @property
    def matrix_params(self) -> int:
        """Elements of all Muon matrices."""
        return sum(i.numel for i in self.matrices)

    @property
    def scalar_params(self) -> int:
        """Elements of all scalar-optimizer parameters."""
        return sum(n for _, n in self.scalars)

    @property
    def total_params(self) -> int:
        """Every trainable parameter."""
        return self.matrix_params + self.scalar_params

    @property
    def experts(self) -> int:
        """Experts per stack (the leading size of the ``(E, m, n)`` items); 0 if dense."""
        return max((i.shape[0] for i in self.matrices if len(i.shape) > 2), default=0)

    @property
    def layers(self) -> tuple[str, ...]:
        """Distinct layer keys of the matrices, in order of appearance."""
        return tuple(dict.fromkeys(str(i.layer) for i in self.matrices))


# ------------------------------------------------------------------ HF configs

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
FAMILIES = (*_LLAMA_LIKE, "gpt2")
"""``model_type`` values :func:`spec_from_hf_config` reads."""


def _field(cfg: Mapping[str, Any], key: str, default: Any = None, *, where: str) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"{where}: field {key!r} is missing (needed for {cfg.get('model_type')})")
    if isinstance(default, bool) or isinstance(value, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: field {key!r} must be true or false, got {value!r}")
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: field {key!r} must be an integer ≥ 1, got {value!r}")
    return value


def _divides(d: int, d_key: str, n: int, n_key: str, where: str) -> None:
    """Refuse a config whose ``n_key`` is not a multiple of ``d_key`` (no such model exists)."""
    if n % d:
        raise ConfigError(
            f"{where}: field {n_key!r} ({n}) must be a multiple of {d_key!r} ({d}); "
            "a model with this config cannot be built"
        )


def spec_from_hf_config(
    cfg: Mapping[str, Any], *, name: str = "config", dtype: torch.dtype = torch.bfloat16
) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face ``config.json`` (as a dict).

    Args:
        cfg: the parsed JSON.
        name: label used in messages and reports.
        dtype: dtype of the parameters (and of what is communicated).

    Raises:
        ConfigError: an unknown ``model_type`` or a missing or invalid field (named).

    Examples:
        >>> spec = spec_from_hf_config(PRESETS["gpt2"], name="gpt2")
        >>> spec.total_params  # the published GPT-2 small count
        124439808
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{name}: a config must be a JSON object, got {type(cfg).__name__}")
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(
            f"{name}: field 'model_type' must be one of {list(FAMILIES)}, got {kind!r}"
        )
    if kind == "gpt2":
        return _gpt2(cfg, name, dtype)
    return _llama_like(cfg, name, dtype)


def _gpt2(cfg: Mapping[str, Any], name: str, dtype: torch.dtype) -> ModelSpec:
    f = lambda k, d=None: _field(cfg, k, d, where=name)  # noqa: E731
    H, L, V, P = f("n_embd"), f("n_layer"), f("vocab_size"), f("n_positions")
    _divides(f("n_head"), "n_head", H, "n_embd", name)  # GPT-2's heads split n_embd
    inner = cfg.get("n_inner") or 4 * H
    mats: list[MatrixItem] = []
    scalars: list[tuple[str, int]] = [
        ("transformer.wte.weight", V * H),
        ("transformer.wpe.weight", P * H),
    ]
    for i in range(L):
        p = f"transformer.h.{i}"
        # HF GPT-2 uses Conv1D, weight (in, out); c_attn is one fused (H, 3H) matrix.
        for sub, shape in (
            ("attn.c_attn", (H, 3 * H)),
            ("attn.c_proj", (H, H)),
            ("mlp.c_fc", (H, inner)),
            ("mlp.c_proj", (inner, H)),
        ):
            mats.append(MatrixItem(f"{p}.{sub}.weight", shape, dtype, layer_key(f"{p}.x")))
            scalars.append((f"{p}.{sub}.bias", shape[1]))
        for ln in ("ln_1", "ln_2"):
            scalars += [(f"{p}.{ln}.weight", H), (f"{p}.{ln}.bias", H)]
    scalars += [("transformer.ln_f.weight", H), ("transformer.ln_f.bias", H)]
    if not cfg.get("tie_word_embeddings", True):
        scalars.append(("lm_head.weight", V * H))
    active = sum(i.numel for i in mats) + sum(n for _, n in scalars)
    return ModelSpec(
        name,
        tuple(mats),
        tuple(scalars),
        active,
        source=f"HF config ({name})",
        heads=f("n_head"),
        kv_heads=f("n_head"),
    )


def _llama_like(cfg: Mapping[str, Any], name: str, dtype: torch.dtype) -> ModelSpec:
    kind = cfg["model_type"]
    f = lambda k, d=None: _field(cfg, k, d, where=name)  # noqa: E731
    H, L, V = f("hidden_size"), f("num_hidden_layers"), f("vocab_size")
    nh = f("num_attention_heads")
    nkv = f("num_key_value_heads", nh)
    # grouped-query attention: every key/value head serves the same number of query heads
    _divides(nkv, "num_key_value_heads", nh, "num_attention_heads", name)
    if not cfg.get("head_dim"):  # without head_dim the heads split hidden_size
        _divides(nh, "num_attention_heads", H, "hidden_size", name)
    hd = cfg.get("head_dim") or H // nh
    hd = _field({"head_dim": hd, "model_type": kind}, "head_dim", where=name)
    # Qwen2 (and Qwen2-MoE) carry q/k/v biases; Llama/Mistral only with attention_bias.
    qkv_bias = kind in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False))
    o_bias = kind not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    qk_norm = kind in ("qwen3", "qwen3_moe")
    tied = bool(cfg.get("tie_word_embeddings", False))
    mats: list[MatrixItem] = []
    scalars: list[tuple[str, int]] = [("model.embed_tokens.weight", V * H)]
    expert_params = active_expert = 0

    def mat(n: str, shape: tuple[int, ...]) -> None:
        mats.append(MatrixItem(n, shape, dtype, layer_key(n)))

    moe_every = 1
    sparse_layers: set[int] = set()
    if kind in ("mixtral", "qwen2_moe", "qwen3_moe"):
        E = f("num_local_experts") if kind == "mixtral" else f("num_experts")
        k = f("num_experts_per_tok")
        if kind != "mixtral":
            moe_every = f("decoder_sparse_step", 1)
        only_dense = set(cfg.get("mlp_only_layers") or [])
        sparse_layers = {i for i in range(L) if i not in only_dense and (i + 1) % moe_every == 0}
    for i in range(L):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        mat(f"{a}.q_proj.weight", (nh * hd, H))
        mat(f"{a}.k_proj.weight", (nkv * hd, H))
        mat(f"{a}.v_proj.weight", (nkv * hd, H))
        mat(f"{a}.o_proj.weight", (H, nh * hd))
        if qkv_bias:
            scalars += [(f"{a}.q_proj.bias", nh * hd), (f"{a}.k_proj.bias", nkv * hd)]
            scalars.append((f"{a}.v_proj.bias", nkv * hd))
        if o_bias:
            scalars.append((f"{a}.o_proj.bias", H))
        if qk_norm:
            scalars += [(f"{a}.q_norm.weight", hd), (f"{a}.k_norm.weight", hd)]
        scalars += [(f"{p}.input_layernorm.weight", H), (f"{p}.post_attention_layernorm.weight", H)]
        if i in sparse_layers:
            if kind == "mixtral":
                I = f("intermediate_size")
                m = f"{p}.block_sparse_moe"
                mat(f"{m}.gate.weight", (E, H))
            else:
                I = f("moe_intermediate_size")
                m = f"{p}.mlp"
                mat(f"{m}.gate.weight", (E, H))
            # fused expert stacks: gate+up as (E, 2I, H) would be one matrix per expert
            # of shape 2I × H; keep gate, up and down separate, as the per-expert
            # Linear layers are (what param_groups sees on the module).
            mat(f"{m}.experts.gate_proj", (E, I, H))
            mat(f"{m}.experts.up_proj", (E, I, H))
            mat(f"{m}.experts.down_proj", (E, H, I))
            expert_params += 3 * E * I * H
            active_expert += 3 * k * I * H
            if kind == "qwen2_moe":
                S = f("shared_expert_intermediate_size")
                s = f"{m}.shared_expert"
                mat(f"{s}.gate_proj.weight", (S, H))
                mat(f"{s}.up_proj.weight", (S, H))
                mat(f"{s}.down_proj.weight", (H, S))
                mat(f"{m}.shared_expert_gate.weight", (1, H))
        else:
            I = f("intermediate_size")
            mat(f"{p}.mlp.gate_proj.weight", (I, H))
            mat(f"{p}.mlp.up_proj.weight", (I, H))
            mat(f"{p}.mlp.down_proj.weight", (H, I))
            if mlp_bias:
                scalars += [(f"{p}.mlp.gate_proj.bias", I), (f"{p}.mlp.up_proj.bias", I)]
                scalars.append((f"{p}.mlp.down_proj.bias", H))
    scalars.append(("model.norm.weight", H))
    if not tied:
        scalars.append(("lm_head.weight", V * H))
    total = sum(i.numel for i in mats) + sum(n for _, n in scalars)
    return ModelSpec(
        name,
        tuple(mats),
        tuple(scalars),
        total - expert_params + active_expert,
        source=f"HF config ({name})",
        heads=nh,
        kv_heads=nkv,
    )


# --------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    # Fields copied from each model's published config.json on the Hugging Face Hub.
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
             "n_positions": 1024, "vocab_size": 50257},
    "llama-3.2-3b": {"model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
                     "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 128256,
                     "tie_word_embeddings": False},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32000,
                   "tie_word_embeddings": False},
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2_moe", "hidden_size": 2048,
                          "intermediate_size": 5632, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 16,
                          "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
                          "decoder_sparse_step": 1, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "tie_word_embeddings": False},
}  # fmt: skip
"""Named presets: the fields of each model's published Hugging Face ``config.json``."""


# ------------------------------------------------------------ module:factory


def spec_from_module(model: torch.nn.Module, name: str = "module") -> ModelSpec:
    """The :class:`ModelSpec` of a built model, split by :func:`dmuon.optim.param_groups`.

    Examples:
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> spec = spec_from_module(m)
        >>> [(i.name, i.shape) for i in spec.matrices], spec.scalar_params
        ([('0.weight', (16, 8)), ('1.weight', (4, 16))], 20)
    """
    from dmuon.optim.assignment import param_groups
    from dmuon.optim.engine.params import item_shape

    mats: list[MatrixItem] = []
    scalars: list[tuple[str, int]] = []
    for group in param_groups(model):
        names = group["param_names"]
        scalar = group.get("rule") == "scalar"
        for n, p in zip(names, group["params"], strict=True):
            if scalar:
                scalars.append((n, p.numel()))
            else:
                mats.append(MatrixItem(n, item_shape(p, group), p.dtype, layer_key(n)))
    total = sum(i.numel for i in mats) + sum(n for _, n in scalars)
    return ModelSpec(name, tuple(mats), tuple(scalars), total, source=f"module ({name})")


def _from_factory(target: str) -> ModelSpec:
    # The current directory is searched first, as by ``python -m dmuon.optim.planner``: the
    # ``dmuon-plan`` console script's sys.path starts at its own bin directory instead, so
    # ``dmuon-plan mymodel:build`` next to mymodel.py would not find it. It stays on the
    # path while the factory runs (which may import more of the user's modules).
    cwd = os.getcwd()
    added = not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path)
    if added:
        sys.path.insert(0, cwd)
    try:
        return _build_factory(target)
    finally:
        if added:
            sys.path.remove(cwd)


def _build_factory(target: str) -> ModelSpec:
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"model {target!r}: cannot import {attr!r} from module {module_name!r} ({err}); "
            "give 'package.module:function' of a function that returns an nn.Module, its "
            "module importable from the current directory or PYTHONPATH"
        ) from err
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as err:  # the user's code: say where it failed, not a traceback
        raise ConfigError(
            f"model {target!r}: the factory raised {type(err).__name__}: {err} (it is called "
            "with no arguments, under torch.device('meta'))"
        ) from err
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model {target!r}: the factory returned {type(model).__name__}, not an nn.Module"
        )
    return spec_from_module(model, target)


def load_model(model: str, *, dtype: torch.dtype = torch.bfloat16) -> ModelSpec:
    """A :class:`ModelSpec` from a preset name, a ``config.json`` path or ``module:factory``.

    Raises:
        ConfigError: nothing of that name, an unreadable file, or a bad config (the
            message names the field and what would be right).

    Examples:
        >>> load_model("llama-3.1-8b").total_params
        8030261248
    """
    if model.lower() in PRESETS:
        return spec_from_hf_config(PRESETS[model.lower()], name=model.lower(), dtype=dtype)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError as err:
            raise ConfigError(f"model: no file {str(path)!r}") from err
        except json.JSONDecodeError as err:
            raise ConfigError(f"model: {str(path)!r} is not valid JSON ({err})") from err
        label = (path.parent.name or "config") if path.name == "config.json" else path.stem
        return spec_from_hf_config(cfg, name=label, dtype=dtype)
    if ":" in model:
        return _from_factory(model)
    raise ConfigError(
        f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}), a config.json "
        "path, nor 'module:factory'"
    )
