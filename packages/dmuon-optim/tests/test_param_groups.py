"""param_groups(model): each kind of parameter lands where the docstring says."""

import pytest
import torch
from torch import nn

from dmuon.optim import RULES, DMuon, param_groups

V, D, E = 50, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, num_heads=2, batch_first=True)
        self.qkv = nn.Linear(D, 2 * D, bias=False)  # custom fused projection (q: D, k: D/2, v: D/2)
        self.mlp = nn.Linear(D, 4 * D)
        self.experts = nn.Parameter(torch.randn(E, D, 2 * D) * 0.02)  # MoE stack
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        q = self.qkv(h)
        e = torch.einsum("btd,edf->btf", h, self.experts)
        return x + self.gain * (a + q[..., :D] + self.mlp(h)[..., :D] + e[..., :D])


class Model(nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.tok_emb = nn.Embedding(V, D)
        self.pos_emb = nn.Parameter(torch.zeros(8, D))
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        if tie:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def where(groups):
    return {a.name: (a.group, a.reason) for a in groups.assignments}


def test_every_kind_of_parameter_goes_where_documented():
    groups = param_groups(Model(tie=True), split_sizes={r"\.qkv\.weight$": (D, D // 2, D // 2)})
    w = where(groups)
    assert w["tok_emb.weight"] == (
        "scalar: embeddings and head",
        "embedding (tied with the output head)",
    )
    assert "lm_head.weight" not in w  # tied: one tensor, listed once
    assert w["pos_emb"][0] == "scalar: embeddings and head"
    assert w["conv.weight"][0] == "matrix: conv"
    assert w["conv.bias"][0] == "scalar: norms, biases and scalars"
    assert w["blocks.0.ln.weight"] == ("scalar: norms, biases and scalars", "norm parameter")
    assert w["blocks.0.attn.in_proj_weight"][1] == "fused QKV (nn.MultiheadAttention)"
    assert w["blocks.0.attn.in_proj_bias"][1] == "bias parameter"
    assert w["blocks.0.attn.out_proj.weight"] == ("matrix", "2-D hidden weight")
    assert w["blocks.1.qkv.weight"][1] == "split_sizes/num_heads"
    assert w["blocks.0.mlp.weight"] == ("matrix", "2-D hidden weight")
    assert w["blocks.0.experts"][0] == "matrix: stacks"
    assert w["blocks.0.gain"][1] == "0-D parameter"
    assert w["frozen.weight"] == (None, "frozen (requires_grad=False)")
    by_name = {g["name"]: g for g in groups}
    assert by_name["matrix: conv"]["flatten"] is True
    assert by_name["matrix: stacks"]["flatten"] is False
    assert by_name["scalar: norms, biases and scalars"]["weight_decay"] == 0.0
    assert "weight_decay" not in by_name["scalar: embeddings and head"]
    fused = [g for g in groups if g.get("split_sizes")]
    assert sorted(g["split_sizes"] for g in fused) == sorted([(D, D, D), (D, D // 2, D // 2)])
    assert all(g["rule"] == "scalar" for g in groups if g["name"].startswith("scalar"))
    assert all("rule" not in g for g in groups if g["name"].startswith("matrix"))
    text = groups.summary()
    assert all(a.name in text for a in groups.assignments)


def test_untied_head_is_found_by_name_and_by_vocabulary_size():
    w = where(param_groups(Model(tie=False)))
    assert w["lm_head.weight"] == ("scalar: embeddings and head", "output head")
    m = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V))
    w = where(param_groups(m))
    assert w["2.weight"][1] == "output head" and w["1.weight"][1] == "2-D hidden weight"


def test_an_inner_linear_as_wide_as_the_vocabulary_is_not_the_head():
    # The MLP's up-projection is D → V (as wide as the vocabulary) but sits in a block;
    # the read-out after the blocks is the head, whatever its name.
    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(D, V)
            self.down = nn.Linear(V, D)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.blocks = nn.ModuleList([Up(), Up()])
            self.readout = nn.Linear(D, V, bias=False)

    w = where(param_groups(Net()))
    assert w["readout.weight"] == ("scalar: embeddings and head", "output head")
    for i in range(2):
        assert w[f"blocks.{i}.up.weight"] == ("matrix", "2-D hidden weight")
        assert w[f"blocks.{i}.down.weight"] == ("matrix", "2-D hidden weight")


def test_no_block_linear_is_taken_for_a_head_the_model_does_not_have():
    """A read-out tied through ``F.linear(h, tok.weight)`` (no head module), a positional
    embedding as wide as the MLP, and a named head followed by an auxiliary block as wide
    as the vocabulary: every block's Linear stays a hidden matrix (the last one was taken
    for the head, the only one of its kind sent to AdamW)."""

    class Up(nn.Module):
        def __init__(self, d: int, width: int) -> None:
            super().__init__()
            self.fc = nn.Linear(d, width)
            self.proj = nn.Linear(width, d)

    class TiedReadout(nn.Module):  # vocab 100, context 256, MLP width 256
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(100, 16), nn.Embedding(256, 16)
            self.blocks = nn.ModuleList(Up(16, 256) for _ in range(3))

    class NamedHeadThenAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.head = nn.Linear(8, 32)
            self.value = Up(8, 32)

    w = where(param_groups(TiedReadout()))
    for i in range(3):
        assert w[f"blocks.{i}.fc.weight"] == ("matrix", "2-D hidden weight"), i
    w = where(param_groups(NamedHeadThenAux()))
    assert w["head.weight"] == ("scalar: embeddings and head", "output head")
    assert w["value.fc.weight"] == ("matrix", "2-D hidden weight")


def test_a_classifier_the_model_holds_as_fc_is_the_head():
    """torchvision's ResNet reads out through ``model.fc``: the head (AdamW); an ``fc`` inside
    a block stays a hidden matrix."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

    class ResNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3)
            self.layer1 = nn.Sequential(Block(), Block())
            self.fc = nn.Linear(8, 10)

    w = where(param_groups(ResNetLike()))
    assert w["fc.weight"] == ("scalar: embeddings and head", "output head")
    assert w["layer1.0.fc.weight"] == ("matrix", "2-D hidden weight")
    # named like a head, model.fc also keeps the vocabulary rule from taking a second one
    model = ResNetLike()
    model.codes, model.proj = nn.Embedding(10, 8), nn.Linear(8, 10)
    w = where(param_groups(model))
    assert w["fc.weight"][1] == "output head" and w["proj.weight"][1] == "2-D hidden weight"


def test_predicates_override_and_frozen_can_be_kept():
    groups = param_groups(
        Model(tie=False),
        matrix=lambda n, p: n == "lm_head.weight",
        scalar=lambda n, p: n.endswith("mlp.weight"),
        include_frozen=True,
        num_heads={r"out_proj": 2},
    )
    w = where(groups)
    assert w["lm_head.weight"] == ("matrix", "matrix predicate")
    assert w["blocks.0.mlp.weight"] == ("scalar: embeddings and head", "scalar predicate")
    assert w["frozen.weight"][0] == "matrix"
    assert [g["num_heads"] for g in groups if g.get("num_heads")] == [2]
    with pytest.raises(ValueError, match="both the matrix and the scalar predicate"):
        param_groups(Model(), matrix=lambda n, p: True, scalar=lambda n, p: True)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_real_model_trains_a_step_with_every_rule(rule):
    torch.manual_seed(0)
    model = Model(tie=True)
    groups = param_groups(model, split_sizes={r"\.qkv\.weight$": (D, D // 2, D // 2)})
    opt = DMuon(groups, lr=1e-3, rule=rule)
    idx = torch.randint(0, V, (2, 8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        if p.requires_grad:
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n


class FusedExperts(nn.Module):
    """Hugging Face's layout of a MoE block's experts: a fused gate/up stack (E, 2I, H) and
    a down stack (E, H, I)."""

    def __init__(self, experts=3, hidden=8, inner=6):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner))


def test_split_sizes_cut_an_expert_stack_like_separate_gate_and_up_matrices():
    """``split_sizes`` on a stack's name orthogonalises each expert's gate and up rows apart:
    the same as DMuon on every expert's gate and up as separate 2-D parameters."""
    torch.manual_seed(0)
    fused = FusedExperts()
    groups = param_groups(fused, split_sizes={r"gate_up_proj$": (6, 6)})
    stacks = [g for g in groups if "gate_up_proj" in g["param_names"]]
    assert stacks and stacks[0]["split_sizes"] == (6, 6) and stacks[0]["flatten"] is False
    assert "split_sizes" not in next(g for g in groups if "down_proj" in g["param_names"])
    parts = [
        nn.Parameter(fused.gate_up_proj.detach()[e, rows].clone())
        for e in range(3)
        for rows in (slice(0, 6), slice(6, 12))
    ]
    kw = dict(lr=0.05, weight_decay=0.01, ns_compute_dtype=torch.float32)
    opt_fused = DMuon([stacks[0]], **kw)
    opt_parts = DMuon([{"params": parts}], **kw)
    unsplit = nn.Parameter(fused.gate_up_proj.detach().clone())
    opt_unsplit = DMuon([{"params": [unsplit], "flatten": False}], **kw)
    for step in range(2):
        g = torch.randn(3, 12, 8, generator=torch.Generator().manual_seed(step))
        fused.gate_up_proj.grad = g.clone()
        unsplit.grad = g.clone()
        for k, p in enumerate(parts):
            p.grad = g[k // 2, (k % 2) * 6 : (k % 2 + 1) * 6].clone()
        for opt in (opt_fused, opt_parts, opt_unsplit):
            opt.step()
    want = torch.stack([torch.cat(parts[2 * e : 2 * e + 2]) for e in range(3)]).detach()
    torch.testing.assert_close(fused.gate_up_proj.detach(), want, rtol=0, atol=1e-6)
    assert (unsplit.detach() - want).abs().max() > 1e-3  # the cut changes the step
