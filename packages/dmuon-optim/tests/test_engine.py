"""The execution-mode machinery on one process: mode choice, the owner exchange on a
world of one, clipping, placeholders in state dicts, step reports."""

import math
import pickle

import pytest
import torch

from dmuon.comm import MatrixItem, plan_owners
from dmuon.optim import DMuon, OwnerExchange, StepReport, clip_grad_norm_, param_groups
from dmuon.optim.engine import MODES, collect_params, item_shape, subplan


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 12),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 3),
    )
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    return model, x, y


def train(model, opt, x, y, steps=3, before_step=None):
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def dedicate_by_hand(model):
    """What dmuon.integrations does, without hooks: plan, exchange, register."""
    named = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    items = [MatrixItem(n, tuple(p.shape), p.dtype, n.split(".")[0]) for n, p in named]
    pairs = list(zip(items, [p for _, p in named], strict=True))
    return OwnerExchange(pairs, plan=plan_owners(items, 1))


def test_without_a_process_group_the_mode_is_single():
    model, _, _ = model_and_data()
    opt = DMuon(param_groups(model))
    assert opt.mode == "single" and opt.engine.world_size == 1
    assert MODES == ("single", "owner", "replicated", "sharded", "sign")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "zero"}, "mode must be one of"),
        ({"pipeline_depth": 0}, "pipeline_depth"),
        ({"mode": "owner"}, "dedicate"),
        ({"distributed": 3}, "distributed="),
    ],
)
def test_bad_mode_arguments_are_named(kwargs, message):
    model, _, _ = model_and_data()
    with pytest.raises((ValueError, TypeError), match=message):
        DMuon(param_groups(model), **kwargs)


def test_sign_mode_refuses_a_rule_without_a_vote():
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match="sign_muon"):
        DMuon(param_groups(model), mode="sign", rule="muon")


@pytest.mark.parametrize("mode", ["replicated", "sign"])
def test_planned_modes_on_one_rank_step_every_matrix(mode):
    model, x, y = model_and_data()
    opt = DMuon(param_groups(model), mode=mode, rule="sign_muon", ns_compute_dtype="float32")
    train(model, opt, x, y, steps=1)
    assert opt.mode == mode and opt.last_step.matrices == 3
    assert sorted(opt.last_step.stepped) == ["0.weight", "2.weight", "4.weight"]


def test_replicated_mode_on_one_rank_equals_single():
    kw = dict(ns_compute_dtype="float32", weight_decay=0.1)
    a, x, y = model_and_data()
    b, _, _ = model_and_data()
    single = train(a, DMuon(param_groups(a), **kw), x, y)
    replicated = train(b, DMuon(param_groups(b), mode="replicated", **kw), x, y)
    for p, q in zip(single, replicated, strict=True):
        assert torch.equal(p, q)


def test_owner_mode_on_one_rank_equals_single_and_is_found_from_the_parameters():
    kw = dict(ns_compute_dtype="float32", weight_decay=0.1)
    a, x, y = model_and_data()
    b, _, _ = model_and_data()
    single = train(a, DMuon(param_groups(a), **kw), x, y)
    exchange = dedicate_by_hand(b)
    opt = DMuon(param_groups(b), **kw)
    assert opt.mode == "owner" and opt.engine.exchange is exchange
    # without hooks, the caller reports the gradients (what the integrations' hooks do)
    ready = exchange.reduction.grad_ready
    owned = train(b, opt, x, y, before_step=lambda: [ready(p) for p in exchange.params])
    for p, q in zip(single, owned, strict=True):
        assert torch.equal(p, q)
    # one pipeline group per unit: the three small layers (0, 2, 4) are one pack
    assert exchange.layer_keys() == ["0..4"] and opt.last_step.groups == 1


def test_owner_mode_skips_a_matrix_no_rank_has_a_gradient_for():
    model, _, _ = model_and_data()
    exchange = dedicate_by_hand(model)
    opt = DMuon(param_groups(model), weight_decay=0.5)
    before = model[2].weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[2].weight.grad = None
    exchange.reduction.grad_ready(model[0].weight)
    opt.step()
    assert torch.equal(model[2].weight.detach(), before)  # no decay, no momentum step
    assert opt.state[model[2].weight]["step"].item() == 0
    assert opt.state[model[0].weight]["step"].item() == 1


def test_the_reductions_start_with_a_gradient_or_a_flush_and_end_with_the_step():
    model, x, y = model_and_data()
    exchange = dedicate_by_hand(model)
    red = exchange.reduction
    opt = DMuon(param_groups(model), distributed=exchange)
    assert not red.started()
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert not red.started()  # no hook here: nothing reported yet
    red.grad_ready(model[0].weight)
    assert red.started()
    opt.step()
    assert not red.started()  # the step ended them
    red.flush()  # no gradient arrived: the flush alone starts them (zeros sent)
    assert red.started()
    opt.zero_grad()  # a discarded step ends them too
    assert not red.started()


def test_a_second_gradient_after_the_layer_was_reduced_is_an_error():
    model, _, _ = model_and_data()
    exchange = dedicate_by_hand(model)
    for p in exchange.params:
        p.grad = torch.zeros_like(p)
        exchange.reduction.grad_ready(p)
    with pytest.raises(RuntimeError, match="no_sync"):
        exchange.reduction.grad_ready(exchange.params[0])
    with exchange.reduction.no_sync():
        exchange.reduction.grad_ready(exchange.params[0])  # skipped: accumulation


def test_owner_mode_refuses_undedicated_matrices_and_later_groups():
    model, _, _ = model_and_data()
    exchange = dedicate_by_hand(model)
    extra = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="not dedicated"):
        DMuon([*param_groups(model), {"params": [extra], "param_names": ["extra"]}])
    opt = DMuon(param_groups(model), distributed=exchange)
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [extra]})
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)


def test_state_dict_records_the_mode_and_loads_placeholders():
    model, x, y = model_and_data()
    opt = DMuon(param_groups(model), mode="replicated")
    train(model, opt, x, y, steps=1)
    sd = opt.state_dict()
    assert sd["distributed"]["mode"] == "replicated"
    assert set(sd["distributed"]["owners"]) == {"0.weight", "2.weight", "4.weight"}
    # a rank that does not own a matrix holds an empty placeholder under the same keys
    index = next(
        i
        for g in sd["param_groups"]
        for i, n in zip(g["params"], g["param_names"], strict=True)
        if n == "2.weight"
    )
    sd["state"][index]["momentum_buffer"] = torch.zeros(0)
    opt.load_state_dict(sd)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_equals_torch_on_one_process(norm_type):
    model, x, y = model_and_data()
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt = DMuon(param_groups(model))
    total = clip_grad_norm_(opt, 0.1, norm_type)
    clipped = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, c in zip(model.parameters(), clipped, strict=True):
        torch.testing.assert_close(p.grad, c)


def test_clip_grad_norm_checks_its_arguments():
    model, _, _ = model_and_data()
    opt = DMuon(param_groups(model))
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(opt, -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(opt, 1.0, 0.0)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(RuntimeError, match=r"non-finite|nan"):
        clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)


def test_step_report_times_the_phases_and_counts_the_matrices():
    model, x, y = model_and_data()
    opt = DMuon(param_groups(model))
    train(model, opt, x, y, steps=1)
    report = opt.last_step
    assert isinstance(report, StepReport)
    assert report.matrices == 3 and report.rule_calls == 3  # three shapes
    assert set(report.seconds) >= {"rule", "apply", "scalar", "total"}
    assert report.as_dict()["mode"] == "single"


def test_params_are_named_and_planned_with_rows_first():
    conv = torch.nn.Conv2d(3, 8, 3)
    groups = param_groups(torch.nn.Sequential(conv))
    params = collect_params(DMuon(groups).param_groups)
    assert [(e.name, e.item.shape, e.matrix) for e in params] == [
        ("0.weight", (8, 27), True),
        ("0.bias", (1, 8), False),
    ]
    assert item_shape(torch.zeros(2, 3, 4), {"flatten": False}) == (2, 3, 4)
    plan = plan_owners([e.item for e in params], 2)
    assert subplan(plan, ["0.bias"]).names == ("0.bias",)
