"""A hyperparameter given as a one-element tensor is read at every step, as in torch.optim.

``torch.optim.AdamW(params, lr=lr_tensor)`` keeps the tensor in its group and reads
it at each step, so ``lr_tensor.fill_(v)`` between steps changes the next step's
learning rate. DMuon used to turn the tensor into a float once, at construction,
and ignore such changes silently. The group now keeps the caller's tensor; each step
checks its value and steps with it.
"""

import pytest
import torch

from dmuon.optim import DMuon

LRS = (0.01, 0.003, 0.0, 0.02)  # the values the tensor takes in place, one per step


def test_a_scalar_group_follows_an_lr_tensor_changed_in_place_as_torch_adamw():
    g = torch.Generator().manual_seed(0)
    start = torch.randn(5, generator=g)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    lr = torch.tensor(LRS[0])
    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = DMuon([{"params": [ours], "rule": "adamw", "lr": lr, **kw}])
    reference = torch.optim.AdamW([theirs], lr=lr, foreach=False, **kw)
    for value in LRS:
        lr.fill_(value)
        grad = torch.randn(5, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # the same code path
    assert opt.param_groups[0]["lr"] is lr  # the caller's tensor, as torch.optim keeps it


def test_a_matrix_group_follows_an_lr_tensor_changed_in_place_as_a_float_lr():
    g = torch.Generator().manual_seed(1)
    start = torch.randn(6, 4, generator=g), torch.randn(4, generator=g)
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    floats = [torch.nn.Parameter(t.clone()) for t in start]
    lr = torch.tensor(LRS[0])
    opt = DMuon([{"params": [ours[0]]}, {"params": [ours[1]], "rule": "adamw"}], lr=lr)
    ref = DMuon([{"params": [floats[0]]}, {"params": [floats[1]], "rule": "adamw"}], lr=LRS[0])
    for value in LRS:
        lr.fill_(value)
        for group in ref.param_groups:  # the float lr, set as a scheduler sets it
            group["lr"] = value
        for p, q in zip(ours, floats, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, floats, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert ours[0].ne(start[0]).any()


def test_an_lr_tensor_set_out_of_range_in_place_is_refused_and_nothing_steps():
    w = torch.nn.Parameter(torch.randn(4, 3))
    lr = torch.tensor(0.01)
    opt = DMuon([w], lr=lr)
    lr.fill_(-1.0)
    w.grad = torch.randn(4, 3)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"param group 0: lr must be .*>= 0.0, got -1.0"):
        opt.step()
    assert torch.equal(w, before) and opt.steps_taken == 0
    assert float(opt.state[w]["step"]) == 0
    lr.fill_(0.02)  # fixed in place: the next step runs with it
    opt.step()
    assert opt.steps_taken == 1 and not torch.equal(w, before)
