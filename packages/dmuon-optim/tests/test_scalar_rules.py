"""Scalar optimizers (AdamW, Lion) are rules of one registry: declared keys and state, one step."""

import pytest
import torch

from dmuon.optim import SCALAR_ALGORITHMS, SCALAR_RULES, DMuon, get_scalar_rule
from dmuon.optim.scalar import scalar_state_shapes


def test_the_algorithms_are_the_registry():
    assert SCALAR_ALGORITHMS == tuple(SCALAR_RULES) == ("adamw", "lion")


def test_an_unknown_scalar_optimizer_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown scalar optimizer 'sgd'.*'adamw', 'lion'"):
        get_scalar_rule("sgd")


def test_the_state_is_what_the_rule_declares():
    p = torch.zeros(2, 3)
    assert scalar_state_shapes("adamw", p) == {"step": (), "exp_avg": (2, 3), "exp_avg_sq": (2, 3)}
    assert scalar_state_shapes("lion", p) == {"step": (), "exp_avg": (2, 3)}
    for name, rule in SCALAR_RULES.items():
        b = torch.nn.Parameter(torch.ones(5))
        opt = DMuon([{"params": [b], "rule": name}])
        assert set(opt.state[b]) == set(rule.state_shapes(b)), name


def test_a_group_takes_exactly_the_keys_its_scalar_rule_declares():
    for name, rule in SCALAR_RULES.items():
        b = torch.nn.Parameter(torch.ones(5))
        group = DMuon([{"params": [b], "rule": name}]).param_groups[0]
        assert set(rule.options) <= set(group), name
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['eps'\] for rule 'lion'"):
        DMuon([{"params": [torch.nn.Parameter(torch.ones(5))], "rule": "lion", "eps": 1e-8}])


def test_the_adamw_rule_is_bitwise_torch_adamw():
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(7, generator=g), torch.randn(3, 2, generator=g)]
    theirs = [torch.nn.Parameter(p.clone()) for p in ours]
    states = [{k: torch.zeros(s) for k, s in scalar_state_shapes("adamw", p).items()} for p in ours]
    group = {"lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}
    reference = torch.optim.AdamW(theirs, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        get_scalar_rule("adamw").update(ours, grads, states, group)
        for p, grad in zip(theirs, grads, strict=True):
            p.grad = grad.clone()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)  # the same code path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_torch_adamw_foreach_and_loop_give_the_same_bits(dtype, weight_decay):
    # adamw_step takes torch's multi-tensor path for plain tensors (scalar._foreach) where
    # torch.optim.AdamW picks the per-parameter loop on a CPU: both must give the same bits
    g = torch.Generator().manual_seed(1)
    shapes = [(16,), (1,), (7, 3), (300,), (64, 65)]
    loop = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]
    multi = [torch.nn.Parameter(p.detach().clone()) for p in loop]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    a = torch.optim.AdamW(loop, foreach=False, **kw)
    b = torch.optim.AdamW(multi, foreach=True, **kw)
    for k in range(6):
        for p, q in zip(loop, multi, strict=True):
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * 10.0 ** (k - 3)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(loop, multi, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])
