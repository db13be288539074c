"""A state dict whose state holds a NaN or an Inf is refused by ``load_state_dict``,
naming the parameter and the state key, before anything changes.

Before: a NaN momentum loaded without a word, and the next step (``nonfinite="raise"``,
finite gradients) wrote NaN into the weight: the step's guard reads the gradients, not
the state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def _trained(mode: str = "single") -> tuple[nn.Module, DMuon]:
    model = _model()
    opt = DMuon(param_groups(model), mode=mode, ns_compute_dtype="float32")
    model(torch.ones(3, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(opt: DMuon) -> list[torch.Tensor]:
    return [
        (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]


@pytest.mark.parametrize(
    ("name", "key", "bad"),
    [
        ("0.weight", "momentum_buffer", float("nan")),  # a Muon matrix
        ("2.bias", "exp_avg_sq", float("inf")),  # an AdamW scalar parameter
    ],
)
def test_nonfinite_state_is_refused_by_name_and_nothing_changes(name, key, bad):
    model, opt = _trained()
    sd = opt.state_dict()
    index = next(
        i
        for g in sd["param_groups"]
        for i, n in zip(g["params"], g["param_names"], strict=True)
        if n == name
    )
    poisoned = sd["state"][index][key].clone()
    poisoned.view(-1)[1] = bad  # one entry is enough
    sd["state"][index] = {**sd["state"][index], key: poisoned}
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=rf"state '{key}' of parameter '{name}'.*NaN or an Inf"):
        opt.load_state_dict(sd)
    after = _snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # still usable, and finite
    model(torch.ones(3, 6)).sum().backward()
    opt.step()
    assert all(p.isfinite().all() for p in model.parameters())


def test_finite_state_near_the_fp32_limit_loads():
    # the check takes the max-abs norm: an l2 norm of these entries would overflow to Inf
    # and refuse a finite state
    _, opt = _trained()
    sd = opt.state_dict()
    for index, st in sd["state"].items():
        if "momentum_buffer" in st:
            big = torch.full_like(st["momentum_buffer"], 3e38)
            sd["state"][index] = {**st, "momentum_buffer": big}
    opt.load_state_dict(sd)


def _sharded_nan(rank: int, world: int) -> tuple[str, bool]:
    # each rank checks the state it keeps (the owner's whole state, placeholders of what
    # another rank steps, DTensor shards of the scalar parameters by their local part): the
    # rank whose state holds the NaN refuses, the other, whose state is finite, loads
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    opt = DMuon(param_groups(model), mode="sharded", ns_compute_dtype="float32")
    model(torch.ones(3, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    sd = opt.state_dict()
    before = _snapshot(opt)
    for index, st in sd["state"].items():
        m = st.get("momentum_buffer")
        if m is not None and rank == 1 and m.numel():
            m = m.clone()
            m.view(-1)[0] = float("nan")
            sd["state"][index] = {**st, "momentum_buffer": m}  # st is the live state's dict
            break
    try:
        opt.load_state_dict(sd)
        message = ""
    except ValueError as err:
        message = str(err)
    return message, all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt), strict=True))


@pytest.mark.timeout(120)
def test_a_nan_in_one_ranks_dtensor_shard_is_refused_on_that_rank():
    (m0, same0), (m1, same1) = run_on_ranks(_sharded_nan, 2, timeout=90)
    assert m0 == ""
    assert "state 'momentum_buffer' of parameter" in m1 and "NaN or an Inf" in m1
    assert same0 and same1
