"""Weights stored ``(in, out)`` — Hugging Face's ``Conv1D`` (GPT-2) — train as their ``(out, in)``
transposes would.

A matrix rule reads a matrix's rows as its output neurons: NorMuon's and AdaMuon's row
statistics, the orientation-sensitive ``adjust_lr`` conventions, Dion2/Dion3's row
selection, MuonBP's blocks, ``split_sizes``/``num_heads``. The same tiny network built
twice, once of ``nn.Linear`` layers and once of ``Conv1D`` layers holding the transposed
weights, trained on the same data with ``DMuon(param_groups(model))``, must end with the
same weights (transposed), for every rule and every ``adjust_lr`` convention.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dmuon.optim import ADJUST_LR, RULES, DMuon, matrix_layout, param_groups

try:  # the extra [hf]; the test does not depend on it
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - depends on the environment

    class Conv1D(nn.Module):  # type: ignore[no-redef]
        """Hugging Face's ``Conv1D``: a linear layer whose weight is stored ``(in, out)``."""

        def __init__(self, nf: int, nx: int):
            super().__init__()
            self.nf, self.nx = nf, nx
            self.weight = nn.Parameter(torch.empty(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))
            nn.init.normal_(self.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
            return out.view(*x.shape[:-1], self.nf)


pytestmark = pytest.mark.usefixtures("one_thread")

# non-square shapes, so that rows and columns differ: 12 → 40 → 24 → 6
SIZES = ((12, 40), (40, 24), (24, 6))
STEPS = 4
TOL = 1e-5


def linear_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, o in SIZES:
        layers += [nn.Linear(i, o), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def conv1d_model(reference: nn.Sequential) -> nn.Sequential:
    """``reference`` rebuilt of ``Conv1D`` layers holding its weights transposed."""
    layers: list[nn.Module] = []
    for m in reference:
        if isinstance(m, nn.Linear):
            c = Conv1D(m.out_features, m.in_features)
            with torch.no_grad():
                c.weight.copy_(m.weight.T)
                c.bias.copy_(m.bias)
            layers.append(c)
        else:
            layers.append(copy.deepcopy(m))
    return nn.Sequential(*layers)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 12, generator=g), torch.randn(16, 6, generator=g)) for _ in range(STEPS)
    ]


def optimizer(model: nn.Module, rule: str, **options) -> DMuon:
    return DMuon(
        param_groups(model),
        rule=rule,
        lr=0.02,
        ns_method="standard",
        ns_compute_dtype="float32",
        **options,
    )


def max_difference(rule: str, **options) -> float:
    """Largest difference of the weights after ``STEPS`` steps, both models in lockstep.

    Sign-Muon takes the sign of the polar factor: the last-bit differences of the two
    backward passes (``x @ W`` and ``x @ Wᵀ`` sum in different orders, ~3e-9 here) flip
    an entry near zero now and then, and its step then differs everywhere (the spectral
    norm of the signs changes), whatever the orientation. For it the Conv1D model is
    handed the Linear model's gradients, transposed, instead of its own.
    """
    ref = linear_model()
    hf = conv1d_model(ref)
    start = ref[0].weight.detach().clone()
    opts = [optimizer(ref, rule, **options), optimizer(hf, rule, **options)]
    exact = rule == "sign_muon"
    for x, y in data():
        for model, opt in zip((ref, hf), opts, strict=True):
            torch.manual_seed(2)  # NuMuon's random start
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
        if exact:
            for a, b in zip(ref, hf, strict=True):
                if isinstance(a, nn.Linear):
                    b.weight.grad.copy_(a.weight.grad.T)
                    b.bias.grad.copy_(a.bias.grad)
        for opt in opts:
            torch.manual_seed(3)
            opt.step()
    moved = float((ref[0].weight.detach() - start).abs().max())
    assert moved > 1e-3, f"{rule}: the weights barely moved ({moved:.1e})"
    return max(
        float((a.weight.detach().T - b.weight.detach()).abs().max())
        for a, b in zip(ref, hf, strict=True)
        if isinstance(a, nn.Linear)
    )


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_trains_conv1d_as_its_transpose(rule):
    diff = max_difference(rule)
    assert diff < TOL, f"{rule}: Conv1D weights differ from the Linear ones by {diff:.2e}"


@pytest.mark.parametrize("adjust_lr", ADJUST_LR, ids=str)
def test_every_adjust_lr_convention_trains_conv1d_as_its_transpose(adjust_lr):
    diff = max_difference("muon", adjust_lr=adjust_lr)
    assert diff < TOL, f"adjust_lr={adjust_lr}: Conv1D weights differ by {diff:.2e}"


def test_param_groups_marks_conv1d_weights_transposed():
    groups = param_groups(conv1d_model(linear_model()))
    marked = [g for g in groups if g.get("transposed")]
    assert len(marked) == 1 and marked[0]["param_names"] == ["0.weight", "2.weight", "4.weight"]
    assert not any(g.get("transposed") for g in param_groups(linear_model()))
    reason = {a.name: a.reason for a in groups.assignments}["0.weight"]
    assert "Conv1D" in reason and "(in, out)" in reason


def test_layout_sees_the_transpose():
    w = torch.zeros(12, 40)  # (in, out)
    lay = matrix_layout(w, {"transposed": True, "split_sizes": (10, 30)}, "w")
    assert lay.flat == (1, 40, 12)
    assert [lay.matrix_shape(b) for b in lay.blocks] == [(10, 12), (30, 12)]
    w[:, 10:] = 1.0  # the second block is the output columns 10..39
    assert bool((lay.block_view(w, lay.blocks[1]) == 1).all())
    assert bool((lay.block_view(w, lay.blocks[0]) == 0).all())


def test_a_split_transposed_matrix_steps_like_its_column_blocks_as_linear_weights():
    """GPT-2's ``c_attn`` ``(E, 3E)`` with ``split_sizes=(E, E, E)``: q, k and v (its column
    blocks) step as three ``(E, E)`` ``nn.Linear``-oriented weights would, each on its own."""
    E = 8
    g = torch.Generator().manual_seed(4)
    fused = nn.Parameter(torch.randn(2 * E, 3 * E, generator=g))  # non-square blocks: (2E, E)ᵀ
    parts = [nn.Parameter(fused.detach()[:, i * E : (i + 1) * E].T.contiguous()) for i in range(3)]
    kw = dict(rule="normuon", lr=0.05, adjust_lr="spectral", ns_compute_dtype="float32")
    opt_fused = DMuon([{"params": [fused], "transposed": True, "split_sizes": (E, E, E)}], **kw)
    opt_parts = DMuon([{"params": parts}], **kw)
    for _ in range(3):
        grad = torch.randn(2 * E, 3 * E, generator=g)
        fused.grad = grad.clone()
        for i, p in enumerate(parts):
            p.grad = grad[:, i * E : (i + 1) * E].T.clone()
        opt_fused.step()
        opt_parts.step()
    whole = torch.cat([p.detach().T for p in parts], dim=1)
    assert float((fused.detach() - whole).abs().max()) < TOL
    # the state keeps the parameter's shape; the per-row state is per output column
    assert opt_fused.state[fused]["momentum_buffer"].shape == fused.shape
    assert opt_fused.state[fused]["row_second_moment"].shape == (3 * E,)


@pytest.mark.parametrize("saved_as", ["views", "contiguous"])
def test_state_dict_round_trip_of_transposed_weights_resumes_exactly(saved_as):
    """``saved_as="contiguous"``: the state as earlier versions kept (and saved) it, a
    contiguous tensor in the parameter's shape; it loads into the stacked buffers."""

    def run(split: bool) -> torch.Tensor:
        model = conv1d_model(linear_model())
        opt = optimizer(model, "normuon")
        batches = data()
        for i, (x, y) in enumerate(batches):
            if split and i == 2:
                saved = copy.deepcopy(opt.state_dict())
                if saved_as == "contiguous":
                    for st in saved["state"].values():
                        for k, v in st.items():
                            st[k] = v.contiguous() if v.dim() == 2 else v
                opt = optimizer(model, "normuon")
                opt.load_state_dict(saved)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        w = model[0].weight
        assert opt.state[w]["momentum_buffer"].shape == w.shape
        return torch.cat([m.weight.detach().flatten() for m in model if isinstance(m, Conv1D)])

    assert torch.equal(run(False), run(True))


def test_transposed_state_is_a_view_of_the_stacked_buffer():
    """No copy of the state in and out of the batch each step: the parameter's state is
    the transposed view of its slice of the bucket's buffer (as an ``nn.Linear``'s is its
    slice), and the rule's in-place update is what ``optimizer.state`` holds."""
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(24, 8), nn.Tanh(), Conv1D(8, 24), nn.Tanh(), Conv1D(24, 8))
    opt = optimizer(model, "normuon")
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    first, third = model[0].weight, model[4].weight  # (8, 24) each: one bucket
    for w in (first, third):
        m = opt.state[w]["momentum_buffer"]
        assert m.shape == w.shape and m.mT.is_contiguous(), (m.shape, m.stride())
        assert bool(m.any()), "the rule's update of the buffer is not in the state"
    storage = [opt.state[w]["momentum_buffer"].untyped_storage().data_ptr() for w in (first, third)]
    assert storage[0] == storage[1], "two weights of one bucket do not share its buffer"


def test_transposed_is_refused_for_more_than_two_dims():
    p = nn.Parameter(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="'transposed' is for 2-D weights"):
        DMuon([{"params": [p], "transposed": True, "flatten": False}])


def test_gpt2_from_transformers_is_grouped_with_transposed_weights_and_a_qkv_split():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    groups = param_groups(model)
    by_name = {n: g for g in groups for n in g["param_names"]}
    c_attn = by_name["transformer.h.0.attn.c_attn.weight"]
    assert c_attn["transposed"] is True and c_attn["split_sizes"] == (16, 16, 16)
    for n in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        g = by_name[f"transformer.h.0.{n}.weight"]
        assert g["transposed"] is True and not g.get("split_sizes"), n
    assert by_name["transformer.wte.weight"]["rule"] == "scalar"  # tied with lm_head
    opt = DMuon(groups, ns_compute_dtype="float32")
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()


def test_a_state_dict_saved_before_the_key_existed_loads_and_resumes_bit_for_bit():
    """Groups saved without ``transposed`` (state dicts of earlier versions) load; the
    state of an ``nn.Linear`` model is what it was, and the steps after are the same."""

    def run(strip: bool) -> torch.Tensor:
        model = linear_model()
        opt = optimizer(model, "normuon")
        for i, (x, y) in enumerate(data()):
            if i == 2:
                saved = copy.deepcopy(opt.state_dict())
                if strip:
                    for g in saved["param_groups"]:
                        g.pop("transposed", None)
                opt = optimizer(model, "normuon")
                opt.load_state_dict(saved)
                assert all(g["transposed"] is False for g in opt.param_groups if "momentum" in g)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(False), run(True))
