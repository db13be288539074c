"""``state_dtype``: matrix-rule state stored in bfloat16, every step's math in fp32.

The reference is the rule re-stated another way: the same optimizer with fp32 state,
its state rounded to bf16 (round-to-nearest-even, ``Tensor.bfloat16()``) by hand after
each step — "fp32 math, state rounded after each step" — which must agree with
DMuon's upcast-on-read / round-on-write to the last bit of fp32 arithmetic.
"""

import re

import pytest
import torch

from dmuon.optim import DMuon, param_groups
from dmuon.optim.state_precision import round_state_, rounding_seed, stochastic_round_bf16


class Tiny(torch.nn.Module):
    """Two same-shape hidden matrices (one stacked bucket), a head, biases (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 32)
        self.h1 = torch.nn.Linear(32, 32)
        self.h2 = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.h1(x))
        return self.out(torch.tanh(self.h2(x)))


def _data(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x[:, :4] * 2)


def _step(model: Tiny, opt: torch.optim.Optimizer, t: int) -> float:
    x, y = _data(t)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _matrix_state(opt: DMuon) -> list[torch.Tensor]:
    return [
        v
        for g in opt.param_groups
        if g["rule"] not in ("adamw", "lion")
        for p in g["params"]
        for k, v in opt.state[p].items()
        if k != "step"
    ]


# fp32 Newton–Schulz, so both paths do the same fp32 arithmetic on the same values
OPT = dict(lr=0.02, ns_compute_dtype="float32")


@pytest.mark.parametrize("rule", ["muon", "normuon", "adamuon"])
def test_bf16_state_equals_fp32_math_with_state_rounded_each_step(rule):
    ref_model, model = Tiny(), Tiny()
    ref = DMuon(param_groups(ref_model), rule=rule, **OPT)
    opt = DMuon(param_groups(model), rule=rule, state_dtype="bfloat16", **OPT)
    for t in range(6):
        _step(ref_model, ref, t)
        with torch.no_grad():  # the re-statement: state rounded to bf16 after the step
            for v in _matrix_state(ref):
                v.copy_(v.bfloat16().float())
        _step(model, opt, t)
    for a, b in zip(_matrix_state(ref), _matrix_state(opt), strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a, rtol=0, atol=0)
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        # the same fp32 operations in the same order: equal up to the order of a sum
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)


def test_bf16_state_halves_the_matrix_state_bytes_and_keeps_scalar_state_fp32():
    fp32 = DMuon(param_groups(Tiny()), rule="normuon")
    bf16 = DMuon(param_groups(Tiny()), rule="normuon", state_dtype=torch.bfloat16)

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    assert nbytes(_matrix_state(bf16)) * 2 == nbytes(_matrix_state(fp32)) > 0
    scalars = [g for g in bf16.param_groups if g["rule"] == "adamw"]
    for p in scalars[0]["params"]:
        assert bf16.state[p]["exp_avg"].dtype == torch.float32


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    # values a fraction q of the way from a bf16 number to its neighbour away from 0
    lo = torch.tensor([1.0, -3.0, 1e-3, 700.0, -2e-5]).bfloat16()
    gap = (torch.nextafter(lo, lo * 2).float() - lo.float()).abs()
    q = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9])
    x = lo.float() + lo.float().sign() * q * gap  # exact in fp32: 16 spare bits
    draws = 4000
    g = torch.Generator().manual_seed(1)
    mean = torch.stack([stochastic_round_bf16(x, g).float() for _ in range(draws)]).mean(0)
    # a Bernoulli(q) times the gap has std ≤ gap/2; 6 σ of the mean of 4000 draws
    assert ((mean - x).abs() <= 6 * 0.5 * gap / draws**0.5).all(), (mean - x) / gap
    nearest_err = (x.bfloat16().float() - x).abs()
    assert (nearest_err >= 0.099 * gap).all()  # nearest is off by ≥ 0.1 gap, always
    # every draw is one of the two neighbours
    r = stochastic_round_bf16(x, g).float()
    assert ((r - x).abs() < gap).all()


def test_stochastic_rounding_is_reproducible_with_the_same_seed():
    x = torch.randn(64, 64)
    a = stochastic_round_bf16(x, torch.Generator().manual_seed(5))
    b = stochastic_round_bf16(x, torch.Generator().manual_seed(5))
    c = stochastic_round_bf16(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_rounding_keeps_infinities_nans_and_saturates():
    src = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38])
    dst = torch.zeros(5, dtype=torch.bfloat16)
    round_state_(dst, src, "nearest")
    big = torch.finfo(torch.bfloat16).max
    assert dst[3] == big and dst[4] == -big  # clamped, not rounded to inf
    out = stochastic_round_bf16(src, torch.Generator().manual_seed(0))
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()


def test_optimizer_with_stochastic_rounding_is_reproducible_and_within_one_ulp():
    runs = []
    for _ in range(2):
        model = Tiny()
        opt = DMuon(param_groups(model), state_dtype="bfloat16", state_rounding="stochastic")
        for t in range(4):
            _step(model, opt, t)
        runs.append([v.clone() for v in _matrix_state(opt)])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    # one step from zero state: M = G exactly in fp32, stored within one bf16 gap of it
    model = Tiny()
    opt = DMuon(param_groups(model), state_dtype="bfloat16", state_rounding="stochastic")
    x, y = _data(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = {p: p.grad.clone() for p in model.parameters()}
    opt.step()
    M = opt.state[model.h1.weight]["momentum_buffer"].float()
    G = grads[model.h1.weight]
    assert ((M - G).abs() <= G.abs() * 2**-7).all()
    assert not torch.equal(M, G.bfloat16().float())  # some entries rounded the other way


def test_rounding_seed_depends_on_step_and_matrix_only():
    assert rounding_seed(3, 1, 0, (32, 32)) == rounding_seed(3, 1, 0, (32, 32))
    seeds = {rounding_seed(s, i, 0, (32, 32)) for s in range(1, 20) for i in range(10)}
    assert len(seeds) == 190


@pytest.mark.parametrize("bad", ["int8", torch.int32, "float7", 16, torch.complex64])
def test_a_state_dtype_that_is_not_a_float_type_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="state_dtype .*got " + re.escape(repr(bad))):
        DMuon(param_groups(Tiny()), state_dtype=bad)


def test_stochastic_rounding_without_bf16_state_is_refused():
    with pytest.raises(ValueError, match=r"state_rounding 'stochastic'.*state_dtype='bfloat16'"):
        DMuon(param_groups(Tiny()), state_rounding="stochastic")
    with pytest.raises(ValueError, match="state_rounding must be one of"):
        DMuon(param_groups(Tiny()), state_dtype="bfloat16", state_rounding="up")


def test_state_dict_round_trip_keeps_bf16_state_exactly():
    model = Tiny()
    opt = DMuon(param_groups(model), rule="normuon", state_dtype="bfloat16")
    for t in range(3):
        _step(model, opt, t)
    saved = opt.state_dict()
    before = [v.clone() for v in _matrix_state(opt)]
    fresh = DMuon(param_groups(model), rule="normuon", state_dtype="bfloat16")
    fresh.load_state_dict(saved)
    for a, b in zip(before, _matrix_state(fresh), strict=True):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a, b)


def test_changing_state_dtype_after_construction_is_refused():
    model = Tiny()
    opt = DMuon(param_groups(model), state_dtype="bfloat16")
    opt.param_groups[0]["state_dtype"] = "float32"
    with pytest.raises(RuntimeError, match="structure"):
        opt.step()


def test_a_tiny_model_trains_with_bf16_state_close_to_fp32_state():
    runs = {}
    for dtype, rounding in [(None, "nearest"), ("bfloat16", "nearest"), ("bfloat16", "stochastic")]:
        model = Tiny()
        opt = DMuon(param_groups(model), lr=0.05, state_dtype=dtype, state_rounding=rounding)
        runs[dtype, rounding] = [_step(model, opt, t % 10) for t in range(30)]
    first, fp32 = runs[None, "nearest"][0], runs[None, "nearest"][-1]
    assert fp32 < 0.7 * first  # it trained, so the comparison says something
    for rounding in ("nearest", "stochastic"):
        bf16 = runs["bfloat16", rounding][-1]
        # measured: within 1.1 % (nearest) and 0.3 % (stochastic) of fp32 state; bf16
        # momentum carries ~3 significant digits, so allow a few percent
        assert abs(bf16 - fp32) <= 0.05 * fp32, (rounding, fp32, bf16)


def test_state_dtype_of_the_parameters_own_dtype_changes_nothing():
    a_model, b_model = Tiny(), Tiny()
    a = DMuon(param_groups(a_model), **OPT)
    b = DMuon(param_groups(b_model), state_dtype="float32", **OPT)
    for t in range(3):
        _step(a_model, a, t)
        _step(b_model, b, t)
    for p, q in zip(a_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fp32_state_for_a_bf16_model_computes_in_fp32():
    # the re-statement: the fp32 model's step from the same bf16 weights, cast once
    model = Tiny().to(torch.bfloat16)
    ref_model = Tiny().to(torch.bfloat16).float()
    opt = DMuon(param_groups(model), state_dtype="float32", **OPT)
    ref = DMuon(param_groups(ref_model), **OPT)
    x, y = _data(0)
    torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        q.grad = p.grad.float()
    opt.step()
    ref.step()
    assert _matrix_state(opt)[0].dtype == torch.float32
    for a, b in zip(_matrix_state(opt), _matrix_state(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # M = G, in fp32 on both sides
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        # the apply runs in the weights' dtype (W − lr·U with U rounded to bf16, in bf16):
        # within a bf16 ulp or two of the fp32 step (2⁻⁹ for these |W| < 0.5)
        torch.testing.assert_close(p.float(), q, rtol=2**-7, atol=4e-3)


@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_state_dict_round_trip_keeps_fp32_state_of_a_bf16_model_exactly(rule):
    # torch's load_state_dict casts every state tensor to its parameter's dtype: fp32
    # momentum of bf16 weights came back through bf16 (2⁻⁹ relative off), and the
    # resumed run left the uninterrupted one
    def step(model: Tiny, opt: DMuon, t: int) -> None:
        x, y = _data(t)
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()

    model = Tiny().to(torch.bfloat16)
    opt = DMuon(param_groups(model), rule=rule, state_dtype="float32", **OPT)
    for t in range(3):
        step(model, opt, t)
    saved = opt.state_dict()
    before = [v.clone() for v in _matrix_state(opt)]
    fresh_model = Tiny().to(torch.bfloat16)
    fresh_model.load_state_dict(model.state_dict())
    fresh = DMuon(param_groups(fresh_model), rule=rule, state_dtype="float32", **OPT)
    fresh.load_state_dict(saved)
    for a, b in zip(before, _matrix_state(fresh), strict=True):
        assert b.dtype == torch.float32
        assert torch.equal(a, b)
    for t in range(3, 5):
        step(model, opt, t)
        step(fresh_model, fresh, t)
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)


SQUARES = {
    "muon2": "grad_second_moment",
    "adamuon": "second_moment",
    "normuon": "row_second_moment",
}


@pytest.mark.parametrize("rule", sorted(SQUARES))
def test_second_moments_of_fp16_parameters_are_kept_in_fp32(rule):
    """``(1 − β₂)·g²`` of gradients near 1e-4 is 0 in fp16: Muon²'s second moment was all
    zeros (each step divided by the current gradient alone, 0.72 off the fp32 run). Kept
    in fp32 (the momentum stays fp16, as the parameters), the fp16 run follows the fp32
    one as the other rules do; ``state_dtype`` still decides when it is given, and the
    state round-trips through a state dict exactly."""
    torch.manual_seed(0)
    w0 = torch.randn(16, 32)
    grads = [1e-4 * torch.randn(16, 32) for _ in range(4)]

    def run(dtype, **kw):
        p = torch.nn.Parameter(w0.to(dtype).clone())
        opt = DMuon([p], rule=rule, lr=0.05, **kw)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        return p, opt

    ref, _ = run(torch.float32)
    p, opt = run(torch.float16)
    state = opt.state[p]
    key = SQUARES[rule]
    assert state[key].dtype == torch.float32 and bool((state[key] != 0).all()), key
    assert state["momentum_buffer"].dtype == torch.float16
    moved = (ref.detach() - w0).norm()
    assert (p.detach().float() - ref.detach()).norm() / moved < 0.05
    # state_dtype given: it decides
    _, narrow = run(torch.float16, state_dtype="bfloat16")
    narrow_state = next(iter(narrow.state.values()))
    assert all(v.dtype == torch.bfloat16 for k, v in narrow_state.items() if k != "step")
    # a state dict keeps the fp32 second moment exactly
    q = torch.nn.Parameter(w0.half().clone())
    other = DMuon([q], rule=rule, lr=0.05)
    other.load_state_dict(opt.state_dict())
    assert other.state[q][key].dtype == torch.float32
    assert torch.equal(other.state[q][key], state[key])
