"""State dicts: a checkpointed run continues bit for bit; bad state dicts are refused
with a clear error and leave the optimizer as it was."""

import copy
import io

import pytest
import torch
from torch import nn

from dmuon.optim import RULES, DMuon, param_groups

K = 3


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 24)
        self.qkv = nn.Linear(24, 48, bias=False)  # unequal split below: gathered state
        self.norm = nn.LayerNorm(48)
        self.out = nn.Linear(48, 32, bias=False)

    def forward(self, x):
        return self.out(self.norm(self.qkv(torch.tanh(self.fc(self.emb(x))))))


def make(rule, scalar="adamw", seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    groups = param_groups(model, split_sizes={r"qkv": (24, 12, 12)})
    return model, DMuon(groups, lr=3e-3, rule=rule, scalar_optimizer=scalar, weight_decay=0.01)


def train(model, opt, steps, start):
    for t in range(start, start + steps):
        x = torch.randint(0, 32, (16,), generator=torch.Generator().manual_seed(t))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), x).backward()
        opt.step()


@pytest.mark.parametrize(
    ("rule", "scalar"), [(r, "adamw") for r in sorted(RULES)] + [("muon", "lion")]
)
def test_round_trip_is_bitwise(rule, scalar):
    straight_model, straight = make(rule, scalar)
    train(straight_model, straight, 2 * K, 0)

    model, opt = make(rule, scalar)
    train(model, opt, K, 0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    fresh_model, fresh = make(rule, scalar, seed=123)  # different init: everything must load
    fresh_model.load_state_dict(ckpt["model"])
    fresh.load_state_dict(state_dict=ckpt["opt"])
    train(fresh_model, fresh, K, K)

    for a, b in zip(straight_model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = straight.state_dict()["state"], fresh.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


def test_loaded_state_does_not_alias_the_state_dict():
    model, opt = make("muon")
    train(model, opt, 1, 0)
    sd = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(sd)
    opt.load_state_dict(sd)
    train(model, opt, 1, 1)
    for i in sd["state"]:
        for k in sd["state"][i]:
            assert torch.equal(sd["state"][i][k], before["state"][i][k])


def test_deepcopy_and_pickle_of_the_optimizer_continue_identically():
    model, opt = make("normuon")
    train(model, opt, 2, 0)
    m2 = copy.deepcopy(model)
    opt2 = DMuon(param_groups(m2, split_sizes={r"qkv": (24, 12, 12)}), rule="normuon")
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    pickled = copy.deepcopy(opt)  # __getstate__/__setstate__ keep the configuration
    assert pickled._rule == "normuon" and len(pickled.state) == len(opt.state)
    train(model, opt, 2, 2)
    train(m2, opt2, 2, 2)
    for a, b in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def assert_unchanged(opt, snap):
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, snap[id(p)][k])


def broken(opt, edit):
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    return sd


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.pop("state"), "missing key"),
        (lambda sd: sd["state"].pop(0), "no state for parameter"),
        (
            lambda sd: sd["state"][0].pop("momentum_buffer"),
            r"missing key\(s\) \['momentum_buffer'\]",
        ),
        (lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(1)), "unexpected key"),
        (
            lambda sd: sd["state"][0].__setitem__("momentum_buffer", torch.zeros(3, 3)),
            r"has shape \(3, 3\); expected",
        ),
        (
            lambda sd: sd["state"][2].__setitem__("row_second_moment", torch.zeros(5)),
            "unexpected key",
        ),
        (lambda sd: sd["state"].__setitem__(99, {"step": torch.zeros(())}), "belong to no group"),
        (lambda sd: sd["param_groups"].pop(), "different number of parameter groups"),
        (lambda sd: sd["param_groups"][0].__setitem__("betas", (0.9, 0.9)), r"unknown key.*betas"),
        (lambda sd: sd["param_groups"][0].__setitem__("momentum", 1.5), "momentum must be"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), "doesn't match the size"),
    ],
)
def test_bad_state_dict_is_refused_and_nothing_changes(edit, message):
    model, opt = make("muon")
    train(model, opt, 2, 0)
    snap = snapshot(opt)
    groups = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(broken(opt, edit))
    assert_unchanged(opt, snap)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    train(model, opt, 1, 2)  # and it still works


def test_state_is_eager_and_state_dict_has_every_parameter():
    _, opt = make("dion3")
    sd = opt.state_dict()
    n = sum(len(g["params"]) for g in opt.param_groups)
    assert sorted(sd["state"]) == list(range(n))
    for g in opt.param_groups:
        assert all(
            isinstance(g[k], (float, int, bool, str, tuple, list, type(None)))
            for k in g
            if k != "params"
        )
