"""What a caller changes between steps is checked at the next step, cheaply, and the
error names the parameter or the key (issue: reliability, round two, defect 9).

Each case is checked against the state it must leave: nothing stepped, nothing
corrupted, the optimizer usable once the change is undone.
"""

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon, NonFiniteGradientError, param_groups


def mat(*shape):
    return nn.Parameter(torch.randn(*shape))


def _model():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("momentum", 1.5, "momentum"),
        ("ns_steps", 0, "ns_steps"),
        ("lr", -1.0, "lr"),
        ("weight_decay", float("nan"), "weight_decay"),
    ],
)
def test_a_group_value_edited_after_construction_is_checked_at_the_next_step(key, value, message):
    p = mat(4, 4)
    opt = DMuon([p])
    p.grad = torch.randn(4, 4)
    before = p.detach().clone()
    good = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param group 0: {message}"):
        opt.step()
    assert torch.equal(p.detach(), before)  # nothing stepped
    opt.param_groups[0][key] = good
    opt.step()  # usable again once the value is fixed
    assert not torch.equal(p.detach(), before)


def test_a_scalar_group_value_edited_after_construction_is_checked():
    model = _model()
    opt = DMuon(param_groups(model))
    scalar = next(i for i, g in enumerate(opt.param_groups) if g["rule"] == "adamw")
    opt.param_groups[scalar]["betas"] = (0.9, 1.5)
    model(torch.randn(3, 6)).sum().backward()
    with pytest.raises(ValueError, match=rf"param group {scalar}: betas"):
        opt.step()


@pytest.mark.parametrize(
    ("rule", "key", "value"),
    [("normuon", "beta_2", 0.9), ("adamw", "amsgrad", True), ("muon", "nestrov", False)],
)
def test_a_key_added_after_construction_is_refused_as_the_constructor_refuses_it(rule, key, value):
    """A misspelt key or an option the rule lacks, added between steps: refused at the
    next step as at construction (before: ignored silently, and the optimizer's own state
    dict then failed to load), the optimizer unchanged and usable once it is removed."""
    p = mat(4, 4) if rule != "adamw" else nn.Parameter(torch.randn(4))
    opt = DMuon([{"params": [p], "rule": rule}])
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0][key] = value
    for _ in range(2):  # refused again: nothing was recorded
        with pytest.raises(ValueError, match=rf"unknown key\(s\) \['{key}'\] for rule '{rule}'"):
            opt.step()
    assert torch.equal(p.detach(), before)
    del opt.param_groups[0][key]
    opt.step()
    DMuon([{"params": [p], "rule": rule}]).load_state_dict(opt.state_dict())


def test_two_values_that_contradict_each_other_are_refused_at_every_step():
    """``state_rounding='stochastic'`` set between steps without ``state_dtype='bfloat16'``:
    refused at this and every later step, as the constructor refuses it (before: accepted,
    the momentum stayed fp32 and the state dict did not load)."""
    p = mat(4, 4)
    opt = DMuon([p])
    p.grad = torch.randn(4, 4)
    opt.param_groups[0]["state_rounding"] = "stochastic"
    for _ in range(2):
        with pytest.raises(ValueError, match="needs state_dtype='bfloat16'"):
            opt.step()
    opt.param_groups[0]["state_rounding"] = "nearest"
    opt.step()


def test_a_scheduler_changing_lr_every_step_passes():
    p = mat(4, 4)
    opt = DMuon([p])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=5)
    for _ in range(4):
        p.grad = torch.randn(4, 4)
        opt.step()
        sched.step()
    assert opt.steps_taken == 4


def test_a_parameter_whose_data_was_replaced_by_another_shape_is_named():
    model = _model()
    opt = DMuon(param_groups(model))
    model[0].weight.data = torch.randn(5, 6)
    model[0].weight.grad = torch.randn(5, 6)
    with pytest.raises(RuntimeError, match=r"'0\.weight'.*shape \(5, 6\).*\(8, 6\)"):
        opt.step()


def test_a_sparse_gradient_is_named_without_the_finiteness_guard():
    model = _model()
    opt = DMuon(param_groups(model), nonfinite=None)
    model[0].weight.grad = torch.randn(8, 6).to_sparse()
    with pytest.raises(RuntimeError, match=r"sparse.*'0\.weight'"):
        opt.step()


@pytest.mark.parametrize("fused", [False, True], ids=["sums", "fused-l1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_finiteness_guard_names_exactly_the_non_finite_gradients(dtype, fused, monkeypatch):
    # The guard sums each gradient first (on a GPU: torch._foreach_norm's ℓ1 norms, forced
    # here on the CPU) and decides by max|g| only where that is not finite: finite entries
    # whose sum overflows must pass, NaN, Inf and +Inf with -Inf must be named, in either
    # dtype.
    from dmuon.optim.engine import guards

    monkeypatch.setattr(guards, "FUSED_DEVICES", ("cpu",) if fused else ())
    big = torch.finfo(dtype).max
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(5)]).to(dtype)
    fills = [
        torch.full((8, 8), big),  # finite, its sum overflows
        torch.ones(8, 8),
        torch.ones(8, 8).index_fill_(0, torch.tensor([3]), float("nan")),
        torch.ones(8, 8).index_fill_(1, torch.tensor([2]), float("inf")),
        torch.ones(8, 8)
        .index_fill_(0, torch.tensor([0]), float("inf"))
        .index_fill_(0, torch.tensor([1]), -float("inf")),
    ]
    for layer, g in zip(model, fills, strict=True):
        layer.weight.grad = g.to(dtype)
    opt = DMuon(param_groups(model), nonfinite="raise")
    before = [layer.weight.detach().clone() for layer in model]
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    assert info.value.names == ["2.weight", "3.weight", "4.weight"]
    assert all(torch.equal(b, layer.weight) for b, layer in zip(before, model, strict=True))
    for layer in model[2:]:
        layer.weight.grad = torch.ones(8, 8, dtype=dtype)
    opt.step()  # all finite now, the overflowing sum included: steps
    assert not torch.equal(before[0], model[0].weight)


def test_the_same_tensor_twice_in_one_group_is_refused():
    p = mat(3, 3)
    with pytest.raises(ValueError, match="twice in param group 0"):
        DMuon([{"params": [p, p]}])
    opt = DMuon([mat(3, 3)])
    with pytest.raises(ValueError, match="twice in param group 1"):
        opt.add_param_group({"params": [p, p]})


def test_the_default_deadline_is_auto_and_grows_with_the_slowest_iteration():
    from dmuon.optim.deadline import AUTO_FLOOR_SECONDS, AUTO_ITERATION_FACTOR, Deadline

    p = mat(4, 4)
    opt = DMuon([p])
    assert opt.timeout == "auto"
    d = Deadline("auto")
    assert d.seconds() == AUTO_FLOOR_SECONDS  # nothing measured yet
    for now in (0.0, 1.0, 31.0, 32.0):  # iterations of 1 s, 30 s, 1 s
        d.observe(now=now)
    assert d.seconds() == max(AUTO_FLOOR_SECONDS, AUTO_ITERATION_FACTOR * 30.0)


@pytest.mark.parametrize("bad", [0, -1.0, True, "soon", float("nan")])
def test_a_bad_timeout_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, 'auto'"):
        DMuon([mat(3, 3)], timeout=bad)


def test_a_bad_option_of_the_default_rule_is_refused_when_no_group_takes_that_rule():
    """``rule="normuon", beta2=1.5`` with every group naming ``"muon"``: refused at
    construction, naming ``beta2`` (before: accepted, shown in ``opt.defaults``, and
    refused only when a later ``add_param_group`` took the default rule)."""
    p = mat(4, 4)
    with pytest.raises(ValueError, match=r"DMuon: beta2 must be"):
        DMuon([{"params": [p], "rule": "muon"}], rule="normuon", beta2=1.5)
    opt = DMuon([{"params": [p], "rule": "muon"}], rule="normuon", beta2=0.5)
    assert opt.defaults["beta2"] == 0.5
