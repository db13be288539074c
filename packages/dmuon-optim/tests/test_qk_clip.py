"""QK-clip (Kimi K2's MuonClip) against a direct re-statement of the paper's equations.

The reference computes every logit of every head explicitly (a loop over heads,
float64, the model's own rotary code for Hugging Face models) and applies
Algorithm 1 of Kimi K2 (arXiv 2507.20534) row by row:

    S_max^h = scale · max_{b,i,j} q_{b,i}^h · k_{b,j}^h,   η_h = min(1, τ / S_max^h),
    W_q^h ← η_h^α W_q^h,   W_k^h ← η_h^{1−α} W_k^h  (grouped-query: the group's min η).

Tolerances: float64 models, so the capture and the reference differ only by the
order of a few dot products (1e-12 relative).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dmuon.optim import AttentionHeads, HeadRows, QKClip, head_max_logits

TAU = 5.0


def causal_bool(n: int) -> torch.Tensor:
    """``nn.MultiheadAttention``'s boolean mask: True = masked out (the future)."""
    return torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)


def blown_up_mha(seed: int = 0, E: int = 8, H: int = 2, bias: bool = True) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, batch_first=True, bias=bias).double()
    with torch.no_grad():
        mha.in_proj_weight[: 2 * E].mul_(6.0)  # large q/k weights: logits far over τ
        if bias:
            mha.in_proj_bias.normal_()
    return mha


def reference_mha(mha: nn.MultiheadAttention, xs: list[torch.Tensor], tau: float, alpha: float):
    """The paper's equations, one head at a time; returns (S_max, new in_proj_weight, bias)."""
    E, H = mha.embed_dim, mha.num_heads
    d = E // H
    W, b = mha.in_proj_weight.detach().clone(), mha.in_proj_bias.detach().clone()
    s_max = torch.full((H,), -math.inf, dtype=torch.float64)
    for x in xs:
        L = x.shape[1]
        for h in range(H):
            rq, rk = slice(h * d, (h + 1) * d), slice(E + h * d, E + (h + 1) * d)
            q = x @ W[rq].T + b[rq]
            k = x @ W[rk].T + b[rk]
            for i in range(L):
                for j in range(i + 1):  # causal
                    s = (q[:, i] * k[:, j]).sum(-1).max() / math.sqrt(d)
                    s_max[h] = max(s_max[h], s)
    for h in range(H):
        eta = min(1.0, tau / float(s_max[h]))
        rq, rk = slice(h * d, (h + 1) * d), slice(E + h * d, E + (h + 1) * d)
        W[rq] *= eta**alpha
        b[rq] *= eta**alpha
        W[rk] *= eta ** (1 - alpha)
        b[rk] *= eta ** (1 - alpha)
    return s_max, W, b


@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_multihead_attention_equals_the_paper_restated(alpha):
    mha = blown_up_mha()
    xs = [torch.randn(3, 5, 8, dtype=torch.float64) for _ in range(2)]  # two micro-batches
    s_ref, w_ref, b_ref = reference_mha(mha, xs, TAU, alpha)
    assert (s_ref > TAU).all(), "the model was meant to blow up"
    clip = QKClip(mha, tau=TAU, alpha=alpha)
    for x in xs:
        mha(x, x, x, attn_mask=causal_bool(5), need_weights=False)
    report = clip.step()
    torch.testing.assert_close(report.max_logits[""].double(), s_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(mha.in_proj_weight.detach(), w_ref, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(mha.in_proj_bias.detach(), b_ref, rtol=1e-6, atol=1e-12)
    assert report.clipped_heads == 2


def test_after_the_clip_the_largest_logit_is_tau():
    mha = blown_up_mha(seed=1)
    x = torch.randn(4, 6, 8, dtype=torch.float64)
    clip = QKClip(mha, tau=TAU)
    mha(x, x, x, need_weights=False)
    assert clip.step().max_logit > 10 * TAU
    mha(x, x, x, need_weights=False)
    after = clip.step()
    # η_h = τ/S_h scales head h's logits exactly by η_h (bias included): its max is τ
    assert after.max_logit <= TAU * (1 + 1e-9)
    assert after.max_logit >= TAU * (1 - 1e-9)
    assert after.clipped_heads == 0


def test_separate_q_k_weights_and_key_padding_mask():
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(8, 2, batch_first=False, kdim=6, vdim=6).double()
    with torch.no_grad():
        mha.q_proj_weight.mul_(8.0)
        mha.in_proj_bias.normal_()
    q_in = torch.randn(4, 3, 8, dtype=torch.float64)  # (L, N, E)
    kv = torch.randn(5, 3, 6, dtype=torch.float64)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    clip = QKClip(mha, tau=TAU)
    mha(q_in, kv, kv, key_padding_mask=pad, need_weights=False)
    wq, wk = mha.q_proj_weight.detach().clone(), mha.k_proj_weight.detach().clone()
    b = mha.in_proj_bias.detach().clone()
    s = clip.step().max_logits[""]
    for h in range(2):
        r = slice(4 * h, 4 * h + 4)
        q = q_in @ wq[r].T + b[r]  # (L, N, d)
        k = kv @ wk[r].T + b[8:16][r]
        logits = torch.einsum("ind,jnd->nij", q, k) / 2.0
        logits[0, :, 3:] = -math.inf  # padded keys of sample 0
        ref = float(logits.max())
        assert float(s[h]) == pytest.approx(ref, rel=1e-9)
        eta = min(1.0, TAU / ref)
        torch.testing.assert_close(mha.q_proj_weight.detach()[r], wq[r] * eta**0.5)
        torch.testing.assert_close(mha.k_proj_weight.detach()[r], wk[r] * eta**0.5)
        torch.testing.assert_close(mha.in_proj_bias.detach()[8:16][r], b[8:16][r] * eta**0.5)
    torch.testing.assert_close(mha.in_proj_bias.detach()[16:], b[16:])  # values untouched


def test_a_companion_to_adamw_keeps_logits_bounded():
    mha = blown_up_mha(seed=3)
    opt = torch.optim.AdamW(mha.parameters(), lr=1e-2)
    clip = QKClip(mha, tau=TAU)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(4, 6, 8, dtype=torch.float64, generator=g)
        out, _ = mha(x, x, x, need_weights=False)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        clip.step()
        with torch.enable_grad():
            mha(x, x, x, need_weights=False)  # the same batch after the clip
        assert clip.step().max_logit <= TAU * (1 + 1e-9)


def test_evaluation_forwards_are_not_recorded_and_nothing_recorded_changes_nothing():
    mha = blown_up_mha(seed=4)
    before = mha.in_proj_weight.detach().clone()
    clip = QKClip(mha, tau=TAU)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        mha(x, x, x)
    report = clip.step()
    assert report.max_logit == -math.inf and report.clipped_heads == 0
    assert torch.equal(mha.in_proj_weight, before)
    clip.remove()
    mha(x, x, x)
    assert clip.step().max_logit == -math.inf


def test_head_max_logits_in_blocks_equals_whole():
    torch.manual_seed(5)
    q, k = torch.randn(2, 6, 9, 4), torch.randn(2, 3, 9, 4)  # GQA: 2 query heads per key head
    allowed = torch.rand(2, 1, 9, 9) > 0.3
    whole = head_max_logits(q, k, 0.5, causal=True, allowed=allowed)
    blocks = head_max_logits(q, k, 0.5, causal=True, allowed=allowed, max_elements=1)
    ref = torch.empty(6)
    for h in range(6):
        s = q[:, h] @ k[:, h // 2].transpose(1, 2) * 0.5
        keep = allowed[:, 0] & torch.ones(9, 9, dtype=torch.bool).tril()
        ref[h] = s.masked_fill(~keep, -math.inf).max()
    torch.testing.assert_close(whole, ref)
    torch.testing.assert_close(blocks, ref)


class TinyMLA(nn.Module):
    """MLA's head layout: per head [q^C | q^R] query rows, [k^C | v] rows of kv_b,
    and one rotary key k^R shared by every head (no rotation here: the clip's rows
    are what is tested)."""

    def __init__(self, clip_holder: list, E: int = 6, H: int = 2, c: int = 2, r: int = 1):
        super().__init__()
        self.E, self.H, self.c, self.r = E, H, c, r
        self.q = nn.Linear(E, H * (c + r), bias=False).double()
        self.kv_b = nn.Linear(E, H * (c + c), bias=False).double()  # [k^C | v] per head
        self.k_rope = nn.Linear(E, r, bias=False).double()  # shared by all heads
        self.holder = clip_holder

    def qk(self, x):
        B, L, _ = x.shape
        q = self.q(x).reshape(B, L, self.H, self.c + self.r).transpose(1, 2)
        kv = self.kv_b(x).reshape(B, L, self.H, 2 * self.c).transpose(1, 2)
        kr = self.k_rope(x)[:, None].expand(B, self.H, L, self.r)
        return q, torch.cat([kv[..., : self.c], kr], dim=-1)

    def forward(self, x):
        q, k = self.qk(x)
        scale = (self.c + self.r) ** -0.5
        if self.holder:
            self.holder[0].record("mla", head_max_logits(q, k, scale, causal=True))
        return q, k, scale


def test_mla_rows_follow_the_paper():
    torch.manual_seed(6)
    holder: list = []
    m = TinyMLA(holder)
    with torch.no_grad():
        for w in (m.q.weight, m.kv_b.weight, m.k_rope.weight):
            w.mul_(5.0)
    heads = AttentionHeads(
        "mla",
        2,
        2,
        (
            HeadRows(m.q.weight, "query", 2, stride=3),  # q^C
            HeadRows(m.q.weight, "query_rope", 1, offset=2, stride=3),  # q^R
            HeadRows(m.kv_b.weight, "key", 2, stride=4),  # k^C (v rows untouched)
        ),
    )
    holder.append(QKClip(m, tau=TAU, modules=[], heads=[heads]))
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    with torch.no_grad():
        q, k, scale = m(x)
    with torch.enable_grad():
        m(x)  # the recorded forward
    wq, wkv, wkr = (w.detach().clone() for w in (m.q.weight, m.kv_b.weight, m.k_rope.weight))
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf).amax(dim=(0, 2, 3))
    report = holder[0].step()
    torch.testing.assert_close(report.max_logits["mla"].double(), s)
    for h in range(2):
        eta = min(1.0, TAU / float(s[h].detach()))
        torch.testing.assert_close(m.q.weight[3 * h : 3 * h + 2], wq[3 * h : 3 * h + 2] * eta**0.5)
        torch.testing.assert_close(m.q.weight[3 * h + 2], wq[3 * h + 2] * eta)
        kc, v = slice(4 * h, 4 * h + 2), slice(4 * h + 2, 4 * h + 4)
        torch.testing.assert_close(m.kv_b.weight[kc], wkv[kc] * eta**0.5)
        torch.testing.assert_close(m.kv_b.weight[v], wkv[v])
    assert torch.equal(m.k_rope.weight, wkr)  # the shared rotary key is never scaled
    holder.clear()
    with torch.no_grad():
        q, k, scale = m(x)
    after = (torch.einsum("bhid,bhjd->bhij", q, k) * scale).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf
    )
    assert float(after.max()) <= TAU * (1 + 1e-9)


def test_half_precision_rows_are_rounded_once():
    from dmuon.optim.row_scaling import scale_rows_

    w = torch.randn(4, 3).bfloat16()
    f = torch.tensor([1.0, 0.3, 0.7, 1 / 3], dtype=torch.float64)
    expected = (w.float() * f.float()[:, None]).bfloat16()  # the exact product, rounded once
    scale_rows_(w, f)
    assert torch.equal(w, expected)


# ------------------------------------------------------------------ Hugging Face

transformers = pytest.importorskip("transformers")


def tiny_hf(kind: str, bias: bool):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per key head
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    torch.manual_seed(7)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif kind == "mistral":  # a sliding window shorter than the sequence
        model = MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(attention_bias=bias, **kw))
    model = model.double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
            if layer.self_attn.q_proj.bias is not None:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
    return model


WINDOW = 3


def reference_hf(model, captured, tau, pad_mask, window=None):
    """The paper's equations with the model's own rotary code, head by head."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out = {}
    for name, (hidden, (cos, sin)) in captured.items():
        attn = model.get_submodule(name)
        H, Hk, d = 4, 2, attn.head_dim
        q = attn.q_proj(hidden).detach()
        k = attn.k_proj(hidden).detach()
        B, L, _ = hidden.shape
        q = q.view(B, L, H, d).transpose(1, 2)
        k = k.view(B, L, Hk, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        s = torch.empty(H, dtype=torch.float64)
        keep = torch.ones(L, L, dtype=torch.bool).tril()[None] & pad_mask[:, None, :]
        if window is not None:  # Mistral's window: query i sees keys i − window < j ≤ i
            keep &= torch.ones(L, L, dtype=torch.bool).triu(diagonal=1 - window)
        for h in range(H):
            logits = q[:, h] @ k[:, h // 2].transpose(1, 2) * attn.scaling
            s[h] = logits.masked_fill(~keep, -math.inf).max()
        eta = torch.clamp(tau / s, max=1.0)
        eta_kv = eta.view(Hk, 2).min(dim=1).values
        rows_q = eta.repeat_interleave(d) ** 0.5
        rows_k = eta_kv.repeat_interleave(d) ** 0.5
        new = {
            "q_proj.weight": attn.q_proj.weight.detach() * rows_q[:, None],
            "k_proj.weight": attn.k_proj.weight.detach() * rows_k[:, None],
        }
        if attn.q_proj.bias is not None:
            new["q_proj.bias"] = attn.q_proj.bias.detach() * rows_q
            new["k_proj.bias"] = attn.k_proj.bias.detach() * rows_k
        out[name] = (s, new)
    return out


@pytest.mark.parametrize(
    ("kind", "bias", "impl"),
    [
        ("llama", False, "eager"),
        ("llama", True, "sdpa"),
        ("qwen2", True, "eager"),
        ("mistral", False, "sdpa"),
    ],
)
def test_hugging_face_attention_equals_the_paper_restated(kind, bias, impl):
    model = tiny_hf(kind, bias)
    model.config._attn_implementation = impl
    captured = {}

    def grab(name):
        def hook(mod, args, kwargs):
            captured[name] = (kwargs["hidden_states"].detach(), kwargs["position_embeddings"])

        return hook

    for name, mod in model.named_modules():
        if name.endswith("self_attn"):
            mod.register_forward_pre_hook(grab(name), with_kwargs=True)
    clip = QKClip(model, tau=TAU)
    assert [a.name for a in clip.attentions] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :2] = False  # left padding of sample 1
    model(input_ids=ids, attention_mask=pad.long(), use_cache=False)
    ref = reference_hf(model, captured, TAU, pad, WINDOW if kind == "mistral" else None)
    report = clip.step()
    for name, (s, new) in ref.items():
        torch.testing.assert_close(report.max_logits[name].double(), s, rtol=1e-9, atol=0)
        attn = model.get_submodule(name)
        for pname, value in new.items():
            torch.testing.assert_close(attn.get_parameter(pname).detach(), value)
    assert report.clipped_heads > 0


# ------------------------------------------------------- Hugging Face GPT-2 (Conv1D)


def tiny_gpt2(by_layer: bool = False, cross: bool = False):
    """GPT-2 with its fused ``c_attn`` stored (in, out); no dropout, so a forward is exact."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        scale_attn_by_inverse_layer_idx=by_layer,  # layer 1's scale: 1/(√d · 2)
        add_cross_attention=cross,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).double()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :64].mul_(30.0)  # q and k columns: logits blow up
            block.attn.c_attn.bias.normal_()
    return model


def gpt2_logits_max(attn, hidden, pad):
    """``S^h`` per head written out: q = x W_q + b_q, k = x W_k + b_k from c_attn's columns."""
    E, H, d = 32, 4, 8
    w, b = attn.c_attn.weight.detach(), attn.c_attn.bias.detach()
    q = hidden @ w[:, :E] + b[:E]
    k = hidden @ w[:, E : 2 * E] + b[E : 2 * E]
    L = hidden.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None] & pad[:, None, :]
    s = torch.empty(H, dtype=torch.float64)
    for h in range(H):
        cols = slice(h * d, (h + 1) * d)
        logits = q[..., cols] @ k[..., cols].transpose(1, 2) * attn.scaling
        s[h] = logits.masked_fill(~keep, -math.inf).max()
    return s


@pytest.mark.parametrize(
    ("impl", "alpha", "by_layer", "padded"),
    [("eager", 0.5, False, True), ("sdpa", 0.5, True, False), ("sdpa", 0.3, False, True)],
)
def test_gpt2_attention_equals_the_paper_restated(impl, alpha, by_layer, padded):
    model = tiny_gpt2(by_layer)
    model.config._attn_implementation = impl
    captured = {}

    def grab(name):
        def hook(mod, args):
            captured[name] = args[0].detach()  # ln_1's output: c_attn's input

        return hook

    for name, mod in model.named_modules():
        if name.endswith(".attn"):
            mod.register_forward_pre_hook(grab(name))
    clip = QKClip(model, tau=TAU, alpha=alpha)
    assert [a.name for a in clip.attentions] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 7, dtype=torch.bool)
    if padded:
        pad[1, :2] = False  # left padding of sample 1
    model(input_ids=ids, attention_mask=pad.long() if padded else None, use_cache=False)
    before = {n: model.get_submodule(n).c_attn for n in captured}
    before = {n: (c.weight.detach().clone(), c.bias.detach().clone()) for n, c in before.items()}
    s_max = {n: gpt2_logits_max(model.get_submodule(n), x, pad) for n, x in captured.items()}
    report = clip.step()
    assert report.clipped_heads > 0
    for name, s in s_max.items():
        torch.testing.assert_close(report.max_logits[name].double(), s, rtol=1e-9, atol=0)
        eta = torch.clamp(TAU / s, max=1.0)
        w, b = before[name]
        want_w, want_b = w.clone(), b.clone()
        for h in range(4):  # head h: query columns 8h.., key columns 32 + 8h..; v untouched
            q, k = slice(8 * h, 8 * h + 8), slice(32 + 8 * h, 32 + 8 * h + 8)
            want_w[:, q] *= eta[h] ** alpha
            want_b[q] *= eta[h] ** alpha
            want_w[:, k] *= eta[h] ** (1 - alpha)
            want_b[k] *= eta[h] ** (1 - alpha)
        c_attn = model.get_submodule(name).c_attn
        torch.testing.assert_close(c_attn.weight.detach(), want_w, rtol=1e-12, atol=0)
        torch.testing.assert_close(c_attn.bias.detach(), want_b, rtol=1e-12, atol=0)
        assert torch.equal(c_attn.weight[:, 64:], w[:, 64:]), "the value columns changed"
        # on the same inputs, every head is now at most τ, a clipped head exactly τ
        after = gpt2_logits_max(model.get_submodule(name), captured[name], pad)
        clipped = s > TAU
        assert bool((after <= TAU * (1 + 1e-12)).all()), f"{name}: {after} over τ"
        torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], TAU))
        torch.testing.assert_close(after[~clipped], s[~clipped], rtol=1e-12, atol=0)


def test_gpt2_cross_attention_is_refused_and_self_attention_can_be_named():
    model = tiny_gpt2(cross=True)
    match = r"attention 'transformer.h.0.crossattention' \(GPT2Attention\) is cross-attention"
    with pytest.raises(ValueError, match=match + r".*pass modules=\[...\] naming"):
        QKClip(model, tau=TAU)
    names = [f"transformer.h.{i}.attn" for i in range(2)]
    assert [a.name for a in QKClip(model, tau=TAU, modules=names).attentions] == names


def test_transposed_head_rows_are_columns():
    c_attn = torch.zeros(4, 12)  # (in, out): 2 heads of 2 in each of q | k | v
    bias = torch.zeros(12)
    part = HeadRows(c_attn, "key", 2, bias=bias, offset=4, transposed=True)
    assert part.rows(2) == [[4, 5], [6, 7]]
    with pytest.raises(
        ValueError, match=r"need 14 rows; the weight of shape \(4, 12\) has 12 columns"
    ):
        HeadRows(c_attn, "key", 2, offset=10, transposed=True).rows(2)
    with pytest.raises(ValueError, match=r"bias of shape \(4,\) does not match .* 12 output"):
        HeadRows(c_attn, "query", 2, bias=torch.zeros(4), transposed=True)
    with pytest.raises(ValueError, match=r"transposed=True is for a matrix .* got shape \(12,\)"):
        HeadRows(bias, "query", 2, transposed=True)


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("tau", [0.0, -1.0, math.nan, math.inf, True, "100"])
def test_tau_must_be_positive_and_finite(tau):
    with pytest.raises(ValueError, match=rf"tau must be a positive finite number, got {tau!r}"):
        QKClip(blown_up_mha(), tau=tau)


def test_alpha_outside_the_unit_interval():
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        QKClip(blown_up_mha(), tau=TAU, alpha=1.5)


def test_unknown_attention_module():
    model = nn.Sequential(nn.Linear(4, 4), blown_up_mha())
    with pytest.raises(TypeError, match=r"module '0' of type torch.nn.modules.linear.Linear"):
        QKClip(model, tau=TAU, modules=[model[0]])


def test_no_attention_found():
    class MyAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(4, 12)

    model = nn.Sequential(nn.Linear(4, 4), MyAttention())
    match = r"no attention module found in Sequential.*\['MyAttention'\]"
    with pytest.raises(ValueError, match=match):
        QKClip(model, tau=TAU)


def test_qk_norm_attention_is_refused():
    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"num_attention_heads": 2, "num_key_value_heads": 2})()
            self.head_dim, self.scaling = 2, 2**-0.5
            self.q_proj, self.k_proj = nn.Linear(4, 4), nn.Linear(4, 4)
            self.q_norm, self.k_norm = nn.LayerNorm(2), nn.LayerNorm(2)

    with pytest.raises(ValueError, match=r"attention 'attn' \(Normed\) normalises q and k"):
        QKClip(nn.ModuleDict({"attn": Normed()}), tau=TAU)


def test_record_checks_name_and_shape():
    clip = QKClip(blown_up_mha(), tau=TAU)
    with pytest.raises(KeyError, match=r"no attention named 'nope'"):
        clip.record("nope", torch.zeros(2))
    with pytest.raises(ValueError, match=r"maxima must have shape \(2,\), got \(3,\)"):
        clip.record("", torch.zeros(3))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_maximum_logit_is_refused_and_nothing_is_scaled(bad):
    """A NaN maximum would give η = 1 (no clip) and hide the divergence; +inf η = 0."""
    mha = blown_up_mha()
    clip = QKClip(mha, tau=TAU)
    before = {n: p.detach().clone() for n, p in mha.named_parameters()}
    clip.record("", torch.tensor([bad, 4 * TAU]))  # head 1 over τ: it would be scaled
    with pytest.raises(RuntimeError, match=r"non-finite maximum logit.*attention '' heads \[0\]"):
        clip.step()
    for n, p in mha.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed by a refused step"
    # the refused step's maxima are gone: the next step clips what it records alone
    clip.record("", torch.tensor([TAU / 2, 4 * TAU]))
    assert clip.step().factors[""].tolist() == [1.0, 0.25]


def test_a_nan_in_the_forward_is_refused_at_the_step():
    mha = blown_up_mha()
    clip = QKClip(mha, tau=TAU)
    before = mha.in_proj_weight.detach().clone()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    x[1, 2, 0] = math.nan  # one token: the queries and keys of its row are NaN
    mha(x, x, x, need_weights=False)
    with pytest.raises(RuntimeError, match=r"attention '' heads \[0, 1\]"):
        clip.step()
    assert torch.equal(mha.in_proj_weight, before)


def test_head_rows_checks():
    w = torch.zeros(6, 4)
    with pytest.raises(ValueError, match=r"role must be one of .* got 'value'"):
        HeadRows(w, "value", 2)
    with pytest.raises(ValueError, match=r"need 8 rows; the weight of shape \(6, 4\) has 6"):
        AttentionHeads("a", 4, 4, (HeadRows(w, "query", 2), HeadRows(w, "key", 2)))
    # the layer and the part are named: which of several weights is too small
    k = torch.zeros(4, 4)
    match = (
        r"attention 'layers.0.attn', parts\[1\]: 4 heads of 2 key rows \(offset 0, stride 2\) "
        r"need 8 rows; the weight of shape \(4, 4\) has 4 rows: at most 2 of these heads fit"
    )
    with pytest.raises(ValueError, match=match):
        AttentionHeads(
            "layers.0.attn", 4, 4, (HeadRows(torch.zeros(8, 4), "query", 2), HeadRows(k, "key", 2))
        )
    match = r"heads \(3\) must be a positive multiple of kv_heads \(2\)"
    with pytest.raises(ValueError, match=match):
        AttentionHeads("a", 3, 2, (HeadRows(w, "query", 2), HeadRows(w, "key", 2)))
