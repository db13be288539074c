"""Scalar optimizers in mixed precision: fp32 state and arithmetic for fp16/bf16 parameters.

In fp16, AdamW's ε = 1e-8 rounds to 0: a parameter whose gradient is zero (an
embedding row no token used, a bias) got ``0/(√0 + 0)`` = NaN on step 1, and step 2
raised ``NonFiniteGradientError`` blaming the gradients. The state of such a
parameter is now fp32 and its step is computed in fp32, then cast once.
"""

import pytest
import torch

from dmuon.optim import SCALAR_ALGORITHMS, DMuon, param_groups

NARROW = [torch.float16, torch.bfloat16]


class Tiny(torch.nn.Module):
    """An embedding (rows 8.. never used), a hidden matrix with a bias, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(tokens)))).sum()


def _model(dtype: torch.dtype) -> Tiny:
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    with torch.no_grad():
        model.hidden.bias.zero_()
    return model


def _train(model: Tiny, opt: torch.optim.Optimizer, steps: int) -> None:
    for t in range(steps):
        tokens = torch.randint(0, 8, (4, 5), generator=torch.Generator().manual_seed(t))
        model(tokens).backward()
        model.hidden.bias.grad.zero_()  # a bias whose gradient is exactly zero
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("algorithm", SCALAR_ALGORITHMS)
@pytest.mark.parametrize("dtype", NARROW)
def test_a_half_precision_model_with_unused_embedding_rows_trains_finite(dtype, algorithm):
    model = _model(dtype)
    opt = DMuon(param_groups(model), lr=0.02, scalar_optimizer=algorithm, nonfinite="raise")
    unused = model.embed.weight.detach()[8:].clone()
    _train(model, opt, 3)  # before: NaN weights after step 1, NonFiniteGradientError at 2
    for name, p in model.named_parameters():
        assert p.dtype == dtype, name
        assert torch.isfinite(p).all(), f"{name} ({dtype}, {algorithm}) is not finite"
    # rows without a gradient: AdamW moves them by weight decay only (m = v = 0:
    # 0/(√0 + ε) = 0 in fp32), Lion by weight decay and sign(0) = 0
    group = next(g for g in opt.param_groups if any(p is model.embed.weight for p in g["params"]))
    decay = 1 - group["lr"] * group["weight_decay"]
    expected = unused
    for _ in range(3):
        expected = (expected.float() * decay).to(dtype)
    assert torch.equal(model.embed.weight.detach()[8:], expected)
    for p in (model.embed.weight, model.hidden.bias, model.head.weight):
        for key, value in opt.state[p].items():
            if key != "step":
                assert value.dtype == torch.float32, f"{key} of a {dtype} parameter"
                assert torch.isfinite(value).all(), key


@pytest.mark.parametrize("dtype", NARROW)
def test_a_half_precision_adamw_step_is_the_fp32_step_cast_once(dtype):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3).to(dtype))
    group = {"params": [p], "rule": "adamw", "lr": 0.01, "betas": (0.9, 0.95)}
    opt = DMuon([{**group, "eps": 1e-8, "weight_decay": 0.1}])
    # reference: torch.optim.AdamW on an fp32 copy whose value is the narrow weight
    wide = torch.nn.Parameter(p.detach().float())
    ref = torch.optim.AdamW([wide], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for t in range(4):
        grad = torch.randn(5, 3, generator=g).to(dtype)
        grad[0] = 0.0  # ε matters here: 0/(√0 + ε)
        p.grad = grad
        opt.step()
        with torch.no_grad():
            wide.copy_(wide.to(dtype).float())  # the weight the narrow parameter holds
        wide.grad = grad.float()
        ref.step()
        assert torch.equal(p.detach(), wide.detach().to(dtype)), f"step {t + 1}"
    assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[wide]["exp_avg_sq"])


@pytest.mark.parametrize("dtype", NARROW)
def test_a_half_precision_lion_step_is_the_fp32_step_cast_once(dtype):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3).to(dtype))
    wide = p.detach().float().clone()
    group = {"params": [p], "rule": "lion", "lr": 1e-3, "betas": (0.9, 0.99)}
    opt = DMuon([{**group, "weight_decay": 0.1}])
    m = torch.zeros(4, 3)
    for _ in range(3):
        grad = torch.randn(4, 3).to(dtype)
        p.grad = grad
        opt.step()
        wide = wide.to(dtype).float()
        c = torch.lerp(m, grad.float(), 0.1)
        wide = wide * (1 - 1e-3 * 0.1) - 1e-3 * c.sign()
        m = torch.lerp(m, grad.float(), 0.01)
        assert torch.equal(p.detach(), wide.to(dtype))
    assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", NARROW)
def test_a_state_dict_round_trip_keeps_the_fp32_state_exactly(dtype):
    model = _model(dtype)
    opt = DMuon(param_groups(model), lr=0.02)
    _train(model, opt, 2)
    saved = opt.state_dict()
    other = DMuon(param_groups(model), lr=0.02)
    other.load_state_dict(saved)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert other.state[p][key].dtype == value.dtype, key
            # torch's load casts to the parameter's dtype; fp32 must not pass through fp16
            assert torch.equal(other.state[p][key], value), key


def test_a_state_dict_saved_with_half_precision_state_is_widened_on_load():
    model = _model(torch.float16)
    opt = DMuon(param_groups(model), lr=0.02)
    _train(model, opt, 2)
    saved = opt.state_dict()
    bias_id = saved["param_groups"][-1]["params"][-1]
    for key in ("exp_avg", "exp_avg_sq"):  # what DMuon wrote before it kept fp32
        saved["state"][bias_id][key] = saved["state"][bias_id][key].half()
    other = DMuon(param_groups(model), lr=0.02)
    other.load_state_dict(saved)
    bias = model.head.bias
    assert other.param_groups[-1]["params"][-1] is bias
    for key in ("exp_avg", "exp_avg_sq"):
        assert other.state[bias][key].dtype == torch.float32
        assert torch.equal(other.state[bias][key], saved["state"][bias_id][key].float())
    _train(model, other, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp32_parameters_keep_fp32_state_in_their_own_tensors():
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = DMuon([{"params": [b], "rule": "adamw"}])
    assert opt.state[b]["exp_avg"].dtype == torch.float64
