"""Inputs a fuzzing review found accepted, then failing later: each is now refused up
front with an error naming the key, and nothing changes.

Before: a step could fail in the scalar (AdamW) group after the matrix groups had
stepped (weights, momentum and per-parameter ``step`` changed, ``steps_taken`` not
counted): a tensor ``adamw_betas`` entry, a value finite in float64 that overflows the
float32 scalars torch's kernels take (``lr=1e38``), a loaded AdamW ``step`` of -1,
``param_names`` shorter than ``params``. ``load_state_dict`` took a negative second
moment (the next step wrote NaN), ``clip_grad_norm_(model.parameters(), 1.0)`` ended in
``AttributeError``, ``ns_steps=2**62`` in ``MemoryError``, ``row_blocks=2**62`` looped
for ever and ``timeout=math.inf`` raised ``OverflowError``.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon, clip_grad_norm_, clip_grad_value_, param_groups
from dmuon.optim.group_record import check_groups
from dmuon.optim.hyperparameters import FLOAT32_MAX
from dmuon.optim.transforms.blocks import block_bounds


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _opt(model: nn.Module, **kw: object) -> DMuon:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DMuon(param_groups(model), **kw)


def _backward(model: nn.Module, seed: int = 1) -> None:
    torch.manual_seed(seed)
    model(torch.randn(5, 4)).square().mean().backward()


def _trained(**kw: object) -> tuple[nn.Module, DMuon]:
    model = _net()
    opt = _opt(model, **kw)
    _backward(model)
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model: nn.Module, opt: DMuon) -> tuple[object, ...]:
    weights = [p.detach().clone() for p in model.parameters()]
    state = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for p in model.parameters()
    ]
    return weights, state, opt.steps_taken


def _assert_unchanged(before: tuple[object, ...], after: tuple[object, ...]) -> None:
    (w0, s0, n0), (w1, s1, n1) = before, after
    assert n0 == n1, "steps_taken changed"
    for a, b in zip(w0, w1, strict=True):  # type: ignore[call-overload]
        assert torch.equal(a, b), "a weight changed"
    for a, b in zip(s0, s1, strict=True):  # type: ignore[call-overload]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"state {k!r} changed"


# --- item 2: a step half-applied (refused up front now) -------------------------------


def test_tensor_adamw_betas_are_plain_floats_and_step_like_floats() -> None:
    # before: accepted, and torch's AdamW raised at the step after the matrices stepped
    model, ref = _net(), _net()
    opt = _opt(model, adamw_betas=(torch.tensor(0.9), 0.95))
    want = _opt(ref, adamw_betas=(0.9, 0.95))
    betas = [g["betas"] for g in opt.param_groups if "betas" in g]
    assert betas and all(type(b) is float for bs in betas for b in bs)
    for m, o in ((model, opt), (ref, want)):
        _backward(m)
        o.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"lr": 1e300}, "lr must be a finite real number >= 0.0 and at most 3.403e+38"),
        ({"weight_decay": 1e39}, "weight_decay must be a finite real number >= 0.0 and at most"),
        ({"adamw_lr": 1e300}, "adamw_lr must be a finite real number >= 0.0 and at most"),
        ({"ns_coefficients": [(1e300, 1e300, 1e300)]}, "ns_coefficients must be one of"),
        ({"rule": "mona", "mona_gamma": 1e300}, "mona_gamma must be a finite real number"),
        # products of values each in range: what the step hands torch as float32 scalars
        ({"lr": 1e38}, "lr × the rule's largest scale"),
        ({"lr": 1e20, "weight_decay": 1e20}, "lr × weight_decay = 1e+40"),
        ({"adamw_lr": 1e38}, "lr / (1 − beta1), AdamW's first step size"),
        ({"rule": "mona", "mona_gamma": 1e38, "momentum": 0.99}, "mona_gamma / (1 − momentum)"),
    ],
)
def test_values_that_overflow_float32_are_refused_at_construction(
    kw: dict[str, object], says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        _opt(_net(), **kw)


@pytest.mark.parametrize(
    ("group", "key", "value", "says"),
    [
        (1, "lr", 1e38, "lr / (1 − beta1)"),  # the AdamW group, after the matrix group
        (1, "weight_decay", 1e39, "weight_decay must be a finite real number >= 0.0 and at"),
        (0, "lr", 1e300, "lr must be a finite real number >= 0.0 and at most"),
        (0, "ns_coefficients", [(1e300, 1.0, 1.0)], "a coefficient is past float32's"),
    ],
)
def test_a_step_refuses_an_overflowing_value_before_anything_changes(
    group: int, key: str, value: object, says: str
) -> None:
    model, opt = _trained()
    assert opt.param_groups[1]["rule"] == "adamw"
    _backward(model, seed=2)
    opt.param_groups[group][key] = value
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=re.escape(f"param group {group}: ")) as err:
        opt.step()
    assert says in str(err.value)
    _assert_unchanged(before, _snapshot(model, opt))


def test_a_tensor_lr_changed_in_place_past_float32_is_refused_at_the_step() -> None:
    model = _net()
    lr = torch.tensor(0.01)
    opt = _opt(model, adamw_lr=lr)
    _backward(model)
    opt.step()
    lr.fill_(1e38)  # finite in float32, but lr / (1 − β₁) is not
    _backward(model, seed=2)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"lr / \(1 − beta1\)"):
        opt.step()
    _assert_unchanged(before, _snapshot(model, opt))


def test_a_tensor_matrix_lr_is_rechecked_by_the_largest_shape_without_reading_the_params(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor lr is re-checked every step (it may change in place); the bound on
    lr·√(m·n) uses the group's largest shape, known since construction, not a read of
    every parameter's size each step."""
    model = _net()
    lr = torch.tensor(0.01)
    opt = _opt(model, lr=lr)
    _backward(model)
    opt.step()
    sizes = 0
    numel = torch.Tensor.numel
    params = {id(p) for g in opt.param_groups for p in g["params"]}

    def counted(self: torch.Tensor) -> int:
        nonlocal sizes
        sizes += id(self) in params
        return numel(self)

    monkeypatch.setattr(torch.Tensor, "numel", counted)
    records = opt._records
    groups = opt.param_groups
    check_groups(records, groups)  # the step's own check of the groups
    assert sizes == 0
    monkeypatch.undo()
    largest = max(p.numel() for p in opt.param_groups[0]["params"])
    lr.fill_(2.0 * FLOAT32_MAX / largest**0.5)  # past the bound by the largest matrix
    _backward(model, seed=2)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"lr × the rule's largest scale"):
        opt.step()
    _assert_unchanged(before, _snapshot(model, opt))


def test_values_in_range_step_as_before() -> None:
    # the products' checks refuse nothing a real run uses
    model = _net()
    opt = _opt(model, lr=1e10, weight_decay=1e-10, adamw_lr=1e5)
    _backward(model)
    opt.step()
    assert opt.steps_taken == 1


# --- item 3: load_state_dict checks the type and the domain of the state --------------


@pytest.mark.parametrize("step", [-1.0, -5.0])
def test_a_negative_adamw_step_is_refused_at_load(step: float) -> None:
    # before: accepted; the next step raised ZeroDivisionError (or a complex cast) after
    # the matrix groups had stepped
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["step"] = torch.tensor(step)  # 0.bias (AdamW)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"state 'step' of parameter '0\.bias'.*negative"):
        opt.load_state_dict(sd)
    _assert_unchanged(before, _snapshot(model, opt))


def test_a_negative_matrix_step_is_refused_at_load() -> None:
    _, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = torch.tensor(-3.0)
    with pytest.raises(ValueError, match=r"state 'step' of parameter '0\.weight'.*step count"):
        opt.load_state_dict(sd)


def test_a_negative_exp_avg_sq_is_refused_at_load() -> None:
    # before: accepted; the next step wrote NaN into 0.bias without a word
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["exp_avg_sq"] = -torch.ones(8)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"'exp_avg_sq' of parameter '0\.bias'.*squares"):
        opt.load_state_dict(sd)
    _assert_unchanged(before, _snapshot(model, opt))


@pytest.mark.parametrize(("rule", "key"), [("normuon", "row_second_moment"),
                                           ("muon2", "grad_second_moment")])  # fmt: skip
def test_a_negative_matrix_second_moment_is_refused_at_load(rule: str, key: str) -> None:
    _, opt = _trained(rule=rule)
    sd = copy.deepcopy(opt.state_dict())
    assert key in sd["state"][0]
    sd["state"][0][key] = -sd["state"][0][key].abs() - 1.0
    with pytest.raises(ValueError, match=rf"state '{key}' of parameter '0\.weight'.*negative"):
        opt.load_state_dict(sd)


def test_momentum_may_be_negative_at_load() -> None:
    # a first moment is signed: only second moments and steps are checked
    _, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["momentum_buffer"] = -sd["state"][0]["momentum_buffer"].abs() - 1.0
    sd["state"][2]["exp_avg"] = -torch.ones(8)
    opt.load_state_dict(sd)


def test_a_string_step_is_named_by_its_type() -> None:
    # before: torch's cast made the string a generator, and the message showed it
    _, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = "3"
    with pytest.raises(ValueError, match="is a str") as err:
        opt.load_state_dict(sd)
    text = str(err.value)
    assert "state 'step' of parameter '0.weight'" in text and "is a str ('3')" in text
    assert "generator" not in text


# --- item 4: param_names ---------------------------------------------------------------


def W(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape))


@pytest.mark.parametrize(
    ("group", "error", "says"),
    [
        ({"params": [W(3, 5), W(4, 6)], "param_names": ["x"]}, ValueError,
         "param group 0: param_names has 1 name(s) for 2 parameter(s)"),
        ({"params": [W(3, 5)], "param_names": ["x", "y", "z"]}, ValueError,
         "param group 0: param_names has 3 name(s) for 1 parameter(s)"),
        ({"params": [W(3, 5), W(3, 5)], "param_names": "ab"}, TypeError,
         "param group 0: param_names must be a list of strings"),
        ({"params": [W(3, 5)], "param_names": [None]}, TypeError,
         "param group 0: param_names[0] must be a str"),
        ({"params": [W(3, 5)], "param_names": [""]}, ValueError,
         "param group 0: param_names[0] is an empty string"),
    ],
)  # fmt: skip
def test_param_names_are_checked(group: dict[str, object], error: type, says: str) -> None:
    with pytest.raises(error) as err:
        DMuon([group])
    assert says in str(err.value)


def test_named_parameters_with_a_non_string_name_are_refused() -> None:
    with pytest.raises(TypeError, match=r"param group 0: param_names\[0\] must be a str"):
        DMuon([(1, W(3, 5))])  # type: ignore[list-item]


def test_good_param_names_are_kept() -> None:
    a, b = W(3, 5), W(4, 6)
    opt = DMuon([{"params": [a, b], "param_names": ("a", "b")}])
    assert opt.param_groups[0]["param_names"] == ["a", "b"]
    opt2 = DMuon([("a", a), ("b", b)])  # type: ignore[list-item]
    assert opt2.param_groups[0]["param_names"] == ["a", "b"]


# --- item 5: clip misuse -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda m, o: clip_grad_norm_(m.parameters(), 1.0),
         "call clip_grad_norm_(opt, max_norm) with the DMuon optimizer, not model.parameters()"),
        (lambda m, o: clip_grad_norm_(torch.optim.SGD(m.parameters(), lr=0.1), 1.0),
         "call clip_grad_norm_(opt, max_norm) with the DMuon optimizer"),
        (lambda m, o: clip_grad_value_(m.parameters(), 1.0),
         "call clip_grad_value_(opt, clip_value) with the DMuon optimizer, not "
         "model.parameters()"),
        (lambda m, o: clip_grad_norm_(o, "1.0"), "max_norm must be a real number, got str"),
        (lambda m, o: clip_grad_norm_(o, 1.0, error_if_nonfinite="no"),
         "error_if_nonfinite must be True or False, got 'no'"),
        (lambda m, o: clip_grad_value_(o, "1.0"), "clip_value must be a real number, got str"),
    ],
)  # fmt: skip
def test_clip_misuse_is_a_type_error(call: object, says: str) -> None:
    model = _net()
    opt = _opt(model)
    _backward(model)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError) as err:
        call(model, opt)  # type: ignore[operator]
    assert says in str(err.value)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)


def test_clip_takes_numbers_and_tensors_as_before() -> None:
    model = _net()
    opt = _opt(model)
    _backward(model)
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    got = clip_grad_norm_(opt, torch.tensor(1e9), error_if_nonfinite=True)
    assert torch.allclose(got, want)
    clip_grad_value_(opt, 1)


# --- item 6: unbounded values --------------------------------------------------------------


def test_ns_steps_is_capped() -> None:
    # before: ns_steps=2**62 built a schedule of that many triples (MemoryError)
    from dmuon.optim.hyperparameters import NS_STEPS_MAX

    with pytest.raises(ValueError, match=rf"ns_steps must be an integer in \[1, {NS_STEPS_MAX}\]"):
        _opt(_net(), ns_steps=2**62)
    _opt(_net(), ns_steps=NS_STEPS_MAX)


@pytest.mark.parametrize("timeout", [math.inf, 1e20, 10**400, float("nan")])
def test_an_infinite_or_too_long_timeout_is_refused(timeout: float) -> None:
    # before: math.inf and 1e20 raised OverflowError from the timedelta
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        _opt(_net(), timeout=timeout)


def test_more_blocks_than_rows_give_one_row_blocks_at_once() -> None:
    # before: row_blocks=2**62 looped over every (empty) block: a hang
    assert block_bounds(3, 2**62) == [(0, 1), (1, 2), (2, 3)]
    for size in range(0, 9):
        for blocks in range(1, 12):
            parts = torch.tensor_split(torch.arange(size), blocks)
            want = []
            start = 0
            for part in parts:
                if len(part):
                    want.append((start, start + len(part)))
                start += len(part)
            assert block_bounds(size, blocks) == want
    model = _net()
    opt = _opt(model, rule="muonbp", row_blocks=2**62)
    _backward(model)
    opt.step()  # 8-row matrices: 8 one-row blocks


def test_float32_max_is_the_bound() -> None:
    from dmuon.optim.hyperparameters import FLOAT32_MAX, real

    assert float(torch.finfo(torch.float32).max) == FLOAT32_MAX
    assert real(0.0)(FLOAT32_MAX) == FLOAT32_MAX
    with pytest.raises(ValueError, match=r"at most 3\.403e\+38"):
        real(0.0)(1e39)
