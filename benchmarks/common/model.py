"""A byte-level GPT: the model every training benchmark, the demo and the integration
tests share.

A decoder-only transformer (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners") over raw bytes (vocabulary 256, no tokenizer):

    h₀ = E[x] (+ P[pos] with learned positions)
    hₗ = hₗ₋₁ + Attn(Norm(hₗ₋₁));  hₗ = hₗ + MLP(Norm(hₗ))        for l = 1..L
    logits = Norm(h_L) · Wₕᵀ                                        (Wₕ = E when tied)

with causal multi-head self-attention (``F.scaled_dot_product_attention``), rotary
(Su et al. 2021, "RoFormer", eq. 34) or learned positions, RMSNorm (Zhang & Sennrich
2019) or LayerNorm, and a GELU MLP. The blocks live in ``model.blocks`` (an
``nn.ModuleList``) so FSDP2 can ``fully_shard`` each one; the hidden matrices (the
ones the Muon family orthogonalises) are exactly the 2-D parameters inside the blocks,
see :func:`hidden_matrix_names`.

Initialisation is a pure function of ``config.seed`` (GPT-2's: N(0, 0.02²), the
residual output projections scaled by 1/√(2L), norms at 1, biases at 0) and leaves
the caller's global RNG untouched, so every optimizer in a comparison starts from
the same weights and every rank of a distributed run builds the same model.

Example:
    >>> import torch
    >>> from benchmarks.common.model import GPT, GPTConfig
    >>> model = GPT(GPTConfig.tiny())
    >>> x = torch.randint(0, 256, (2, 16))
    >>> model(x).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "GPTConfig", "hidden_matrix_names"]

QKV = Literal["fused", "separate"]
Norm = Literal["rmsnorm", "layernorm"]
Positions = Literal["rotary", "learned"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and options of :class:`GPT`.

    The default (6 layers, width 256, 4 heads, context 256) has about 4.8 M
    parameters: a few minutes of training per optimizer on 2 CPU cores.

    Args:
        vocab_size: 256 for bytes.
        seq_len: the longest context the model accepts (learned positions and the
            rotary table are this long).
        n_layer: number of transformer blocks.
        d_model: residual width.
        n_head: attention heads; ``d_model`` must be a multiple of it (and the head
            width even for rotary positions).
        mlp_ratio: MLP hidden width = ``mlp_ratio · d_model``.
        qkv: ``"fused"`` (one ``d × 3d`` projection, ``attn.qkv``) or ``"separate"``
            (``attn.q``, ``attn.k``, ``attn.v``).
        norm: ``"rmsnorm"`` or ``"layernorm"``.
        positions: ``"rotary"`` (no parameters) or ``"learned"`` (``pos_emb``).
        tie_embeddings: use the token embedding as the output head.
        bias: biases in the linear layers.
        rope_base: the rotary frequency base θ.
        seed: the initialisation seed.
    """

    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 6
    d_model: int = 256
    n_head: int = 4
    mlp_ratio: float = 4.0
    qkv: QKV = "fused"
    norm: Norm = "rmsnorm"
    positions: Positions = "rotary"
    tie_embeddings: bool = False
    bias: bool = False
    rope_base: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_head={self.n_head}")
        if self.positions == "rotary" and (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"rotary positions need an even head width, got d_model/n_head = "
                f"{self.d_model}/{self.n_head} = {self.d_model // self.n_head}"
            )
        if self.mlp_ratio <= 0 or int(self.mlp_ratio * self.d_model) < 1:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio!r}")
        choices = {
            "qkv": ("fused", "separate"),
            "norm": ("rmsnorm", "layernorm"),
            "positions": ("rotary", "learned"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @classmethod
    def tiny(cls, **overrides: object) -> GPTConfig:
        """A two-layer, width-32 model for tests (about 30 k parameters)."""
        fields: dict[str, object] = {"seq_len": 32, "n_layer": 2, "d_model": 32, "n_head": 2}
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        return int(self.mlp_ratio * self.d_model)


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model)
    return nn.LayerNorm(config.d_model, bias=config.bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoFormer eq. 34 on pairs (x₁ᵢ, x₂ᵢ) = (first half, second half) of each head."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused or separate q/k/v projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.fused = config.qkv == "fused"
        if self.fused:
            self.qkv = nn.Linear(d, 3 * d, bias=config.bias)
        else:
            self.q = nn.Linear(d, d, bias=config.bias)
            self.k = nn.Linear(d, d, bias=config.bias)
            self.v = nn.Linear(d, d, bias=config.bias)
        self.proj = nn.Linear(d, d, bias=config.bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        B, T, d = x.shape
        if self.fused:
            q, k, v = self.qkv(x).split(d, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # heads by their width, not their count: under tensor parallelism (colwise q/k/v)
        # each rank holds n_head / tp of them
        hd = d // self.n_head
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            cos, sin = rope
            q, k = _rotate(q, cos[:T], sin[:T]), _rotate(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_hidden, bias=config.bias)
        self.proj = nn.Linear(config.mlp_hidden, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + Attn(Norm(x))`` then ``x + MLP(Norm(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm2 = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Byte-level GPT; ``forward(idx)`` gives logits, ``loss(idx, targets)`` the mean
    cross-entropy in nats per byte.

    Args:
        config: the shape and options; ``config.seed`` fixes the initial weights.

    Examples:
        >>> import torch
        >>> from benchmarks.common.model import GPT, GPTConfig
        >>> a, b = GPT(GPTConfig.tiny(seed=3)), GPT(GPTConfig.tiny(seed=3))
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        True
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # Module constructors draw their default init from the global RNG; fork it so
        # building a model never changes the caller's random stream.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            if config.positions == "learned":
                self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.norm_f = _norm(config)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if config.positions == "rotary":
            cos, sin = self._rope_table(config)
            # Not persistent: derived from the config, recomputed on load.
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(config.seed)

    @staticmethod
    def _rope_table(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
        half = config.head_dim // 2
        inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), inv_freq)
        return angles.cos().float(), angles.sin().float()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter from ``seed`` (default ``config.seed``).

        Parameters are visited in registration order with one private generator, so
        the result depends on the seed and the config only. Call it after
        materialising a model built on the meta device.
        """
        g = torch.Generator().manual_seed(self.config.seed if seed is None else seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if isinstance(module, nn.Linear) and name.endswith(".proj"):
                    std = residual_std
                else:
                    std = 0.02
                if module is self.lm_head and self.config.tie_embeddings:
                    continue  # the embedding it shares was initialised already
                w = torch.empty(module.weight.shape).normal_(0.0, std, generator=g)
                module.weight.copy_(w)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    bias.zero_()
            elif isinstance(module, nn.RMSNorm | nn.LayerNorm):
                if module.weight is not None:
                    module.weight.fill_(1.0)
                norm_bias = getattr(module, "bias", None)
                if norm_bias is not None:
                    norm_bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
        T = idx.shape[1]
        if self.config.seq_len < T:
            raise ValueError(f"sequence length {T} exceeds config.seq_len={self.config.seq_len}")
        x = self.tok_emb(idx)
        rope = None
        if self.config.positions == "learned":
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        else:
            rope = (self.rope_cos, self.rope_sin)
        for block in self.blocks:
            x = block(x, rope)
        return self.lm_head(self.norm_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats per byte), computed in fp32."""
        logits = self(idx)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())


def hidden_matrix_names(model: GPT) -> list[str]:
    """Names of the 2-D weights inside the transformer blocks.

    These are the matrices the Muon family orthogonalises; the embeddings, the
    output head, norms and biases are left to AdamW. Every optimizer factory in
    :mod:`benchmarks.common.optimizers` uses this one split (and weight decay on
    exactly these matrices), so comparisons differ only in the matrix update.
    """
    return [
        name for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2
    ]
