"""``ddp.dedicate`` / ``fsdp.dedicate`` arguments of the wrong kind: a TypeError naming
the argument at the call, where they ended in an AttributeError inside the split
(``dedicate(model.parameters())``), at the first step (``stats=1``) or in the plan's
sorting, for ``ddp`` only (``layer_of`` returning an int). One process: the world of one
rank, as in test_dedicate.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.comm import CommStats
from dmuon.integrations import ddp, fsdp, split_parameters
from dmuon.optim import DMuon, param_groups

KINDS = ["ddp", "ddp_owner", "fsdp"]


def dedicate(kind: str):
    """``ddp.dedicate`` (scalars all-reduced, or owned) or ``fsdp.dedicate``."""
    if kind == "ddp_owner":
        return lambda *a, **k: ddp.dedicate(*a, scalars="owner", **k)
    return ddp.dedicate if kind == "ddp" else fsdp.dedicate


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def untouched(model: nn.Module) -> bool:
    """No hook of a dedication was left on the model."""
    return all(
        not m._forward_hooks and not m._forward_pre_hooks and not m._state_dict_pre_hooks
        for m in model.modules()
    ) and all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "model",
    [lambda: net().parameters(), lambda: list(net().parameters()), lambda: None],
    ids=["generator", "list", "None"],
)
def test_something_not_a_module_is_a_type_error_saying_dedicate_model(kind, model):
    with pytest.raises(TypeError, match=r"call dedicate\(model\), not dedicate\(model\.parameters"):
        dedicate(kind)(model())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stats", [1, "stats", object(), {}])
def test_stats_must_be_a_comm_stats_or_none(kind, stats):
    """``stats=1`` was kept and failed at the first step (``'int' object has no attribute
    'count_call'``)."""
    m = net()
    with pytest.raises(TypeError, match=r"stats must be None .* or a dmuon\.comm\.CommStats"):
        dedicate(kind)(m, stats=stats)
    assert untouched(m)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("result", [3, None, ("0",), b"0"])
def test_layer_of_must_return_a_str_naming_layer_of_and_the_parameter(kind, result):
    """An int was a TypeError from ``re`` inside the plan for ``ddp`` (the all-reduced
    parameters' keys are sorted) and taken as ``"3"`` by ``fsdp``: now both refuse it."""
    m = net()
    with pytest.raises(TypeError, match=r"layer_of\('0\.weight'\) returned .*a str"):
        dedicate(kind)(m, layer_of=lambda name: result)
    assert untouched(m)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layer_of": None}, r"layer_of must be a function name -> layer key"),
        ({"layer_of": "blocks"}, r"layer_of must be a function"),
        ({"predicate": 1}, r"predicate must be None or a function \(name, param\) -> bool"),
    ],
)
def test_predicate_and_layer_of_must_be_callable(kind, kwargs, match):
    with pytest.raises(TypeError, match=match):
        dedicate(kind)(net(), **kwargs)


def test_split_parameters_names_a_layer_of_that_returns_no_str():
    with pytest.raises(TypeError, match=r"layer_of\('0\.weight'\) returned 0 \(int\)"):
        split_parameters(net(), layer_of=lambda name: int(name.split(".")[0]))


@pytest.mark.parametrize("kind", KINDS)
def test_good_arguments_still_dedicate_and_step(kind):
    stats = CommStats()
    m = net()
    ded = dedicate(kind)(
        m,
        stats=stats,
        layer_of=lambda name: "block" + name.split(".")[0],
        predicate=lambda name, p: p.ndim == 2,
    )
    assert {i.layer for i in ded.plan.items} >= {"block0", "block2"}
    if kind != "fsdp":  # fsdp needs fully_shard for the rest; the dedication is enough here
        opt = DMuon(param_groups(m), distributed=ded)
        m(torch.randn(3, 4)).square().mean().backward()
        opt.step()
    ded.undedicate()
