"""Where an attention layer's heads live in its weights, and each row's QK-clip factor.

Kimi K2 (arXiv 2507.20534, §2.1, Algorithm 1) clips head ``h`` after the optimizer
step with ``η_h = min(1, τ / S_max^h)``:

* multi-head attention: ``W_q^h ← η_h^α W_q^h``, ``W_k^h ← η_h^{1−α} W_k^h``
  (α = 0.5: ``√η_h`` each), so every logit of head ``h`` is multiplied by ``η_h``;
* MLA: the head-specific non-rotary parts ``q^C, k^C`` get ``η_h^α, η_h^{1−α}``, the
  head-specific rotary query ``q^R`` gets ``η_h``, and the rotary key ``k^R``, shared
  by all heads, is left alone (scaling it would change every head).

Grouped-query attention (a key head ``g`` read by the query heads ``G(g)``) is not
in the paper. The rule here keeps the paper's guarantee, *every clipped head's
largest logit becomes at most τ*, and touches no head that is not over τ more than
its group requires: query head ``h`` gets ``η_h^α`` and key head ``g`` gets
``(min_{h∈G(g)} η_h)^{1−α}`` — the factor of the largest logit of the group, i.e.
the key head is clipped for ``S_max^g = max_{h∈G(g)} S_max^h``. The logit of head ``h``
is multiplied by ``η_h^α · η_g^{1−α} ≤ η_h``. With one query head per key head this
is the paper's rule exactly. (Megatron-LM's ``clip_qk`` likewise clips per query
group; the ``min`` over the group is this project's statement of it.)

A bias is a row of its own: ``q = W_q x + b_q``, so ``b_q``'s rows take the factor of
``W_q``'s rows (Qwen2 has q/k biases) and ``q`` is scaled exactly. Rotary embeddings
are linear in ``q`` and ``k``, so a factor on the rows passes through them.

"Rows" are output features. A weight stored ``(in_features, out_features)`` (Hugging
Face's ``Conv1D``: GPT-2's fused ``c_attn``, ``q|k|v = x W + b``) has them as its
columns; :class:`HeadRows` says so with ``transposed=True`` and the factors scale its
columns (and its bias's entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ROLES", "AttentionHeads", "HeadRows", "clip_factors", "group_factors"]

#: What a block of rows is: ``"query"`` (η^α), ``"query_rope"`` (η: MLA's
#: head-specific rotary query), ``"key"`` (η^{1−α} of its query group).
ROLES = ("query", "query_rope", "key")


@dataclass(frozen=True, eq=False)
class HeadRows:
    """One part of every head in a projection's rows (its bias, if any, alike).

    Head ``h``'s part is rows ``offset + h·stride + [0, count)`` of ``weight``
    (and of ``bias``): output features, the weight's columns when ``transposed``.
    Query roles count ``heads`` heads, ``"key"`` counts ``kv_heads`` (see
    :class:`AttentionHeads`).

    Attributes:
        weight: the projection weight ``(out_features, in_features)`` (or
            ``(in_features, out_features)`` with ``transposed``) — a plain
            tensor or a DTensor (any shard of rows or columns) — or a bias
            ``(out_features,)`` on its own (a packed bias whose weights are apart).
        role: one of :data:`ROLES`.
        count: rows per head in this part (a head's dimension).
        bias: the projection's bias ``(out_features,)``, or ``None``.
        offset: the first row of head 0 (e.g. ``embed_dim`` for the keys of
            ``nn.MultiheadAttention``'s packed ``in_proj_weight``).
        stride: rows from one head's part to the next (default ``count``; larger
            when the heads interleave parts, e.g. MLA's ``[q^C | q^R]`` per head).
        transposed: ``weight`` is a matrix stored ``(in_features, out_features)``
            (Hugging Face's ``Conv1D``, GPT-2): the rows above are its columns.

    Examples:
        >>> import torch
        >>> w = torch.nn.Linear(4, 2 * 3).weight  # 2 heads of (2 non-rotary + 1 rotary) rows
        >>> HeadRows(w, "query_rope", count=1, offset=2, stride=3).rows(2)
        [[2], [5]]
        >>> c_attn = torch.zeros(4, 3 * 4)  # GPT-2's Conv1D: (in, out), q|k|v by columns
        >>> HeadRows(c_attn, "key", count=2, offset=4, transposed=True).rows(2)
        [[4, 5], [6, 7]]
    """

    weight: torch.Tensor
    role: str
    count: int
    bias: torch.Tensor | None = None
    offset: int = 0
    stride: int | None = None
    transposed: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.stride is not None and self.stride < self.count:
            raise ValueError(f"stride ({self.stride}) must be >= count ({self.count})")
        if self.weight.dim() not in (1, 2):
            raise ValueError(
                f"weight must be a matrix (out_features, in_features) or a bias, got shape "
                f"{tuple(self.weight.shape)}"
            )
        if self.transposed and self.weight.dim() != 2:
            raise ValueError(
                f"transposed=True is for a matrix stored (in_features, out_features), got "
                f"shape {tuple(self.weight.shape)}"
            )
        if self.bias is not None and tuple(self.bias.shape) != (self.out_features,):
            raise ValueError(
                f"bias of shape {tuple(self.bias.shape)} does not match the weight's "
                f"{self.out_features} output features (weight shape {tuple(self.weight.shape)}"
                + (", stored (in, out)" if self.transposed else "")
                + ")"
            )

    @property
    def out_dim(self) -> int:
        """The dimension of ``weight`` that holds the rows (1 when ``transposed``)."""
        return 1 if self.transposed else 0

    @property
    def out_features(self) -> int:
        """How many rows (output features) ``weight`` has."""
        return int(self.weight.shape[self.out_dim])

    def rows(self, heads: int) -> list[list[int]]:
        """The rows of each of ``heads`` heads (checked against the weight's rows).

        Raises:
            ValueError: the heads need more rows than the weight has (the role, the
                rows needed, the weight's shape and how many heads would fit).
        """
        stride = self.count if self.stride is None else self.stride
        last = self.offset + (heads - 1) * stride + self.count
        if last > self.out_features:
            what = "columns (output features, stored (in, out))" if self.transposed else "rows"
            room = self.out_features - self.offset - self.count
            fit = 0 if room < 0 else room // stride + 1
            raise ValueError(
                f"{heads} heads of {self.count} {self.role} rows (offset {self.offset}, "
                f"stride {stride}) need {last} rows; the weight of shape "
                f"{tuple(self.weight.shape)} has {self.out_features} {what}: at most {fit} of "
                "these heads fit (check the head count, count, offset and stride)"
            )
        return [
            list(range(self.offset + h * stride, self.offset + h * stride + self.count))
            for h in range(heads)
        ]


@dataclass(frozen=True, eq=False)
class AttentionHeads:
    """One attention layer as QK-clip sees it: its heads and the rows that make them.

    Attributes:
        name: a name, the same on every rank (the module's name in the model).
        heads: query heads ``H``.
        kv_heads: key heads ``H_kv`` (``H`` a multiple of it; query head ``h`` reads
            key head ``h // (H / H_kv)``).
        parts: the query and key rows (:class:`HeadRows`). MLA's shared rotary key
            is simply not listed. They hold the tensors themselves: build them
            after ``fully_shard`` (which replaces a module's parameters).

    Examples:
        >>> import torch
        >>> q, k = torch.nn.Linear(8, 4 * 2), torch.nn.Linear(8, 2 * 2)  # GQA: 4 over 2
        >>> heads = AttentionHeads(
        ...     "attn", 4, 2, (HeadRows(q.weight, "query", 2), HeadRows(k.weight, "key", 2))
        ... )
        >>> eta = clip_factors(torch.tensor([50.0, 400.0, 90.0, 100.0]), 100.0)
        >>> group_factors(eta, heads.kv_heads)  # key head 0 serves query heads 0 and 1
        tensor([0.2500, 1.0000])
    """

    name: str
    heads: int
    kv_heads: int
    parts: tuple[HeadRows, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(
                f"attention {self.name!r}: heads ({self.heads}) must be a positive multiple "
                f"of kv_heads ({self.kv_heads})"
            )
        if not any(p.role != "key" for p in self.parts) or not any(
            p.role == "key" for p in self.parts
        ):
            raise ValueError(
                f"attention {self.name!r} needs query rows and key rows, got roles "
                f"{[p.role for p in self.parts]}"
            )
        for i, p in enumerate(self.parts):
            try:
                p.rows(self.kv_heads if p.role == "key" else self.heads)
            except ValueError as err:  # name the layer and the part, not just the numbers
                raise ValueError(f"attention {self.name!r}, parts[{i}]: {err}") from None


def group_factors(eta: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``η_g = min_{h∈G(g)} η_h`` per key head: the factor of the group's largest logit."""
    return eta.reshape(kv_heads, -1).amin(dim=1)


def clip_factors(s_max: torch.Tensor, tau: float) -> torch.Tensor:
    """``η_h = τ / S_max^h`` where ``S_max^h > τ``, else 1 (Kimi K2, Algorithm 1).

    Examples:
        >>> import torch
        >>> clip_factors(torch.tensor([50.0, 400.0, float("-inf")]), 100.0)
        tensor([1.0000, 0.2500, 1.0000])
    """
    over = s_max > tau
    return torch.where(over, tau / torch.where(over, s_max, 1.0), 1.0)


def row_factors(
    attention: AttentionHeads, eta: torch.Tensor, alpha: float
) -> list[tuple[HeadRows, torch.Tensor]]:
    """Each part with its per-head factor: η^α, η or η_g^{1−α} by role."""
    eta_kv = group_factors(eta, attention.kv_heads)
    out = []
    for part in attention.parts:
        if part.role == "query":
            f = eta.pow(alpha)
        elif part.role == "query_rope":
            f = eta
        else:
            f = eta_kv.pow(1.0 - alpha)
        out.append((part, f))
    return out


def scale_vectors(
    attentions: Sequence[AttentionHeads], etas: Sequence[torch.Tensor], alpha: float
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Every touched tensor (weights and biases) with its full per-row factor vector and
    the dimension the vector runs along (1 for a ``transposed`` weight's columns).

    Parts that share a tensor (``nn.MultiheadAttention``'s packed ``in_proj_weight``,
    GPT-2's ``c_attn``) multiply into one vector, so each tensor is scaled once.
    """
    vectors: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
    for attention, eta in zip(attentions, etas, strict=True):
        for part, f in row_factors(attention, eta, alpha):
            heads = attention.kv_heads if part.role == "key" else attention.heads
            index = torch.tensor(part.rows(heads), device=f.device)  # (heads, count)
            for t, dim in ((part.weight, part.out_dim), (part.bias, 0)):
                if t is None:
                    continue
                if id(t) not in vectors:
                    ones = torch.ones(t.shape[dim], device=f.device, dtype=f.dtype)
                    vectors[id(t)] = (t, ones, dim)
                elif vectors[id(t)][2] != dim:
                    raise ValueError(
                        f"attention {attention.name!r}: a tensor of shape {tuple(t.shape)} is "
                        "described both as (out, in) and as (in, out) (transposed); describe "
                        "every part of one weight alike"
                    )
                vec = vectors[id(t)][1]
                vec[index.flatten()] *= f[:, None].expand_as(index).flatten()
    return list(vectors.values())
