"""A state dict whose groups hold other parameters, or whose state was saved in another
mode (DTensor against plain tensors), is refused by name before anything changes; a
group appended to ``param_groups`` directly is refused by name at the step.

Before: two same-shape groups swapped loaded silently (each parameter took the other's
momentum and learning rate); FSDP2's DTensor state loaded into plain state failed
inside torch's copy half-way, leaving the state mixed and every later step failing; an
appended group raised ``KeyError: 1``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon


def _stepped(names: list[str], lrs: list[float]) -> tuple[DMuon, dict[str, nn.Parameter]]:
    torch.manual_seed(0)
    params = {n: nn.Parameter(torch.randn(4, 4)) for n in ("a", "b")}
    groups = [
        {"params": [params[n]], "param_names": [n], "lr": lr}
        for n, lr in zip(names, lrs, strict=True)
    ]
    opt = DMuon(groups, ns_compute_dtype="float32")
    for p in params.values():
        p.grad = torch.randn(4, 4)
    opt.step()
    return opt, params


def test_groups_in_another_order_are_refused_by_name_and_nothing_changes():
    saved, _ = _stepped(["a", "b"], [0.1, 0.01])
    opt, params = _stepped(["b", "a"], [0.01, 0.1])  # the same groups, swapped
    before = {n: opt.state[p]["momentum_buffer"].clone() for n, p in params.items()}
    with pytest.raises(
        ValueError,
        match=r"param group 0 of the state dict holds \['a'\], this optimizer's holds \['b'\]",
    ):
        opt.load_state_dict(saved.state_dict())
    for n, p in params.items():
        assert torch.equal(opt.state[p]["momentum_buffer"], before[n]), n
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.1]
    opt.load_state_dict(opt.state_dict())  # its own dict still loads


def test_a_group_appended_to_param_groups_is_refused_by_name():
    opt, _ = _stepped(["a", "b"], [0.1, 0.01])
    opt.param_groups.append({"params": [nn.Parameter(torch.ones(3, 3))], **opt.defaults})
    with pytest.raises(
        RuntimeError, match=r"param group 2 was appended to param_groups directly.*add_param_group"
    ):
        opt.step()


def _dtensor_into_plain(rank: int, world: int) -> tuple[str, bool]:
    from torch.distributed.fsdp import fully_shard

    from dmuon.optim import param_groups

    def build(sharded: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        if sharded:
            fully_shard(model)
        mode = "sharded" if sharded else "single"
        return model, DMuon(param_groups(model), mode=mode, ns_compute_dtype="float32")

    plain, plain_opt = build(False)
    plain(torch.ones(2, 4)).sum().backward()
    plain_opt.step()
    model, opt = build(True)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    try:
        opt.load_state_dict(plain_opt.state_dict())
        message = ""
    except ValueError as err:
        message = str(err)
    unchanged = all(
        type(v) is type(before[id(p)][k])
        and torch.equal(v.full_tensor(), before[id(p)][k].full_tensor())
        if hasattr(v, "full_tensor")
        else torch.equal(v, before[id(p)][k])
        for p, s in opt.state.items()
        for k, v in s.items()
    )
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # still usable
    return message, unchanged


@pytest.mark.timeout(120)
def test_dtensor_state_against_plain_state_is_refused_before_anything_changes():
    for message, unchanged in run_on_ranks(_dtensor_into_plain, 2, timeout=90):
        assert "was saved as a plain tensor, and this optimizer keeps a DTensor" in message
        assert "dmuon.integrations.checkpoint" in message
        assert unchanged


def test_a_group_saved_with_another_rule_is_refused_before_anything_changes():
    # before: the saved rule replaced the group's, past the checks the constructor runs
    # for its mode (sign mode's ranks then diverged; owner mode ran sign_muon)
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    saved = DMuon([{"params": [w], "param_names": ["w"]}], rule="dion2")
    w.grad = torch.randn(4, 4)
    saved.step()
    opt = DMuon([{"params": [w], "param_names": ["w"]}])
    with pytest.raises(
        ValueError, match=r"saved with rule 'dion2', this optimizer's steps it with 'muon'"
    ):
        opt.load_state_dict(saved.state_dict())
    assert (
        opt.param_groups[0]["rule"] == "muon"
        and not opt.state[w].get("momentum_buffer", torch.zeros(1)).any()
    )


def test_a_dict_saved_from_the_bare_model_loads_into_the_wrapped_one():
    # names gain DDP's "module." or torch.compile's "_orig_mod." under a wrapper: the same
    # parameters in the same order, which torch pairs by position (review: refused once)
    from dmuon.optim import param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    saved = DMuon(param_groups(model), ns_compute_dtype="float32")
    model(torch.ones(2, 4)).sum().backward()
    saved.step()
    wrapped = nn.Module()
    wrapped.module = model  # DDP's layout
    opt = DMuon(param_groups(wrapped), ns_compute_dtype="float32")
    assert opt.param_groups[0]["param_names"][0].startswith("module.")
    opt.load_state_dict(saved.state_dict())
    p = model[0].weight
    assert torch.equal(opt.state[p]["momentum_buffer"], saved.state[p]["momentum_buffer"])
