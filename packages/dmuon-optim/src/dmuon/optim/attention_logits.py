"""Per-head maximum pre-softmax attention logits, the quantity QK-clip bounds.

Kimi K2 (arXiv 2507.20534, §2.1, MuonClip) defines, for head ``h`` and the step's
batch ``B``:

    S_max^h = (1/√d) · max_{X ∈ B} max_{i,j} Q_i^h · K_j^h

— the *signed* maximum (not the absolute value used in Su's blog post) of the
query–key products times the softmax scale. Here the scale is the one the model
multiplies its logits by before the softmax (``1/√d`` for
``nn.MultiheadAttention`` and ``scaled_dot_product_attention``; the module's
``scaling`` attribute for Hugging Face attention), so that ``S_max^h`` is exactly
the largest number the softmax of head ``h`` sees. Only the pairs ``(i, j)`` the
model attends to count: a causal model's future keys, padded keys and any position
its mask removes are left out (an additive mask's finite entries, e.g. ALiBi, are
*not* added: the clip bounds ``q·k``, the part the weights it scales produce).

The logits are computed again from the queries and keys, a block of query positions
at a time so that at most ``max_elements`` logits exist at once (fp32, or fp64 for
fp64 models); nothing of
this enters autograd.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_MAX_ELEMENTS", "allowed_from_mask", "head_max_logits"]

#: Logits held at once by :func:`head_max_logits` (2^24 fp32 values = 64 MiB).
DEFAULT_MAX_ELEMENTS = 1 << 24


def allowed_from_mask(mask: torch.Tensor, *, true_means_attend: bool) -> torch.Tensor:
    """A boolean "attends" mask from a model's attention mask.

    A boolean mask is taken as it is (``true_means_attend``: Hugging Face and
    ``scaled_dot_product_attention``) or negated (``nn.MultiheadAttention``, where
    ``True`` masks a position out). An additive float mask allows the entries above
    half the dtype's lowest value: the models write ``-inf`` or ``finfo.min`` where
    a position is masked out, ``0`` (or a finite bias) where it is kept.

    Raises:
        TypeError: ``mask`` is not a tensor (e.g. a flex-attention ``BlockMask``).
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attention mask of type {type(mask).__name__} is not supported for logit "
            "capture; use a tensor mask (attn_implementation 'eager' or 'sdpa')"
        )
    if mask.dtype == torch.bool:
        return mask if true_means_attend else ~mask
    return mask > torch.finfo(mask.dtype).min / 2


@torch.no_grad()
def head_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    allowed: torch.Tensor | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> torch.Tensor:
    """``S_max^h = scale · max_{b,i,j} q_{b,h,i} · k_{b,g(h),j}`` for every query head ``h``.

    Args:
        q: queries ``(batch, heads, q_len, d)`` as the softmax sees them (after any
            rotary embedding).
        k: keys ``(batch, kv_heads, k_len, d)``; ``heads`` must be a multiple of
            ``kv_heads``. Grouped-query attention: query head ``h`` reads key head
            ``g(h) = h // (heads / kv_heads)`` (Hugging Face's ``repeat_kv``).
        scale: the softmax scale the model multiplies ``q·k`` by.
        causal: query ``i`` attends keys ``j ≤ i`` only (top-left aligned, as
            ``scaled_dot_product_attention(is_causal=True)``).
        allowed: boolean, broadcastable to ``(batch, heads, q_len, k_len)``: ``True``
            where the model attends. Combined with ``causal`` when both are given.
        max_elements: at most this many logits are formed at once (the query
            positions are taken in blocks).

    Returns:
        ``(heads,)`` in fp32 (fp64 for fp64 inputs); ``-inf`` for a head that attends
        nothing.

    Raises:
        ValueError: shapes that do not match.

    Examples:
        >>> import torch
        >>> q = torch.tensor([[[[0.0, 2.0], [1.0, 0.0]]]])  # 1 batch, 1 head, 2 positions
        >>> k = torch.tensor([[[[3.0, 0.0], [0.0, 5.0]]]])
        >>> head_max_logits(q, k, 1.0)  # q·k: [[0, 10], [3, 0]]
        tensor([10.])
        >>> head_max_logits(q, k, 1.0, causal=True)  # query 0 cannot see key 1
        tensor([3.])
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be (batch, heads, len, d), got shapes {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    b, heads, q_len, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k of shape {tuple(k.shape)} does not match q of shape {tuple(q.shape)}")
    kv_heads, k_len = k.shape[1], k.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if max_elements < 1:
        raise ValueError(f"max_elements must be >= 1, got {max_elements}")
    rep = heads // kv_heads
    # (b, kv_heads, rep, q_len, d): query heads grouped under the key head they read
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 models
    qg = q.to(dtype).reshape(b, kv_heads, rep, q_len, d)
    kf = k.to(dtype)
    if allowed is not None:
        allowed = allowed.expand(b, heads, q_len, k_len).reshape(b, kv_heads, rep, q_len, k_len)
    best = torch.full((kv_heads, rep), float("-inf"), device=q.device, dtype=dtype)
    if q_len == 0 or k_len == 0:
        return best.reshape(heads)
    block = max(1, max_elements // max(1, b * heads * k_len))
    for start in range(0, q_len, block):
        stop = min(q_len, start + block)
        logits = torch.einsum("bgrid,bgjd->bgrij", qg[:, :, :, start:stop], kf) * scale
        keep = None
        if causal:
            i = torch.arange(start, stop, device=q.device)[:, None]
            keep = torch.arange(k_len, device=q.device)[None, :] <= i
        if allowed is not None:
            a = allowed[:, :, :, start:stop]
            keep = a if keep is None else a & keep
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)))
    return best.reshape(heads)
