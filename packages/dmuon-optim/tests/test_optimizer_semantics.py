"""DMuon behaves as a torch.optim.Optimizer: closures, zero_grad, hooks, schedulers,
add_param_group, plain hyperparameters, the rule key — and the scalar
optimizers are exactly AdamW and Lion."""

import copy

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon, SignVote, local_vote, param_groups


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_of(m, t=0):
    g = torch.Generator().manual_seed(t)
    return m(torch.randn(32, 8, generator=g)).square().mean()


def test_closure_is_called_with_grad_enabled_and_its_loss_returned():
    m = model()
    opt = DMuon(param_groups(m))
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(m)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in m.parameters()]
    loss = opt.step(closure)
    assert calls == [True] and isinstance(loss, torch.Tensor)
    assert all(not torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


def test_zero_grad_clears_gradients():
    m = model()
    opt = DMuon(param_groups(m))
    loss_of(m).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    loss_of(m).backward()
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in m.parameters())


def test_step_and_state_dict_hooks_run():
    m = model()
    opt = DMuon(param_groups(m))
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append("sd"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
    loss_of(m).backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert seen == ["pre", "post", "sd", "load-pre", "load-post"]


def test_hyperparameters_are_plain_values_and_every_group_has_a_rule():
    """Plain values, except a tensor the caller passed: the group keeps that object (read
    at every step, as torch.optim does; test_tensor_hyperparameters.py)."""
    m = model()
    groups = param_groups(m)
    lr = torch.tensor(0.5)
    opt = DMuon(groups, lr=1, momentum=0.9, adamw_lr=lr)
    assert [g["rule"] for g in opt.param_groups] == ["muon", "adamw"]
    for g in opt.param_groups:
        for k, v in g.items():
            if k not in ("params", "param_names") and v is not lr:
                assert isinstance(v, (float, int, bool, str, tuple, type(None))), (k, v)
    assert type(opt.param_groups[0]["lr"]) is float
    assert opt.param_groups[1]["lr"] is lr and float(opt.param_groups[1]["lr"]) == 0.5


def test_the_deprecated_algorithm_key_still_names_the_rule():
    m = model()
    groups = [{**g, "algorithm": g.pop("rule", "muon")} for g in param_groups(m)]
    with pytest.warns(FutureWarning, match="param group 0: the key 'algorithm' is deprecated") as w:
        opt = DMuon(groups, lr=0.02)
    assert w[0].filename == __file__  # points at the caller's line, not into dmuon or torch
    assert [g["rule"] for g in opt.param_groups] == ["muon", "adamw"]
    assert all("algorithm" not in g for g in opt.param_groups)
    with pytest.raises(ValueError, match=r"param group 0: 'rule'='muon' and the deprecated "):
        DMuon([{"params": [m[0].weight], "rule": "muon", "algorithm": "normuon"}])


def test_a_state_dict_saved_with_the_algorithm_key_loads():
    torch.manual_seed(0)
    m = model()
    opt = DMuon(param_groups(m), lr=0.02)
    loss_of(m).backward()
    opt.step()
    old = opt.state_dict()
    for g in old["param_groups"]:  # as 0.1.0 pre-releases saved it
        g["algorithm"] = g.pop("rule")
    fresh = DMuon(param_groups(m), lr=0.02)
    with pytest.warns(FutureWarning, match="'algorithm' is deprecated") as w:
        fresh.load_state_dict(old)
    assert w[0].filename == __file__
    assert [g["rule"] for g in fresh.param_groups] == ["muon", "adamw"]
    for p in m.parameters():
        for key, value in opt.state[p].items():
            torch.testing.assert_close(fresh.state[p][key], value, rtol=0, atol=0)


def test_scalar_placeholder_takes_the_scalar_optimizer():
    opt = DMuon(
        [{"params": [nn.Parameter(torch.zeros(3))], "rule": "scalar"}], scalar_optimizer="lion"
    )
    assert opt.param_groups[0]["rule"] == "lion"
    assert (
        set(opt.param_groups[0]) >= {"lr", "betas", "weight_decay"}
        and "eps" not in opt.param_groups[0]
    )


def test_named_parameters_give_param_names():
    m = model()
    opt = DMuon([(n, p) for n, p in m.named_parameters() if p.ndim == 2])
    assert opt.param_groups[0]["param_names"] == ["0.weight", "2.weight"]


def test_add_param_group_checks_keys_and_creates_state_at_once():
    m = model()
    opt = DMuon([m[0].weight])
    opt.add_param_group({"params": [m[2].weight], "rule": "normuon", "beta2": 0.9})
    assert set(opt.state[m[2].weight]) == {"step", "momentum_buffer", "row_second_moment"}
    assert opt.param_groups[1]["lr"] == opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['beta2'\]"):
        opt.add_param_group({"params": [m[0].bias], "rule": "adamw", "beta2": 0.9})
    opt.add_param_group({"params": [m[0].bias, m[2].bias], "rule": "scalar"})
    loss_of(m).backward()
    opt.step()
    assert opt.state[m[2].bias]["step"].item() == 1


def run_schedule(make_scheduler, steps=6):
    m = model()
    opt = DMuon(param_groups(m), lr=0.01)
    sched = make_scheduler(opt)
    lrs = []
    for t in range(steps):
        opt.zero_grad()
        loss = loss_of(m, t)
        loss.backward()
        opt.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(1.0)
        else:
            sched.step()
    m2 = model()
    opt2 = DMuon(param_groups(m2), lr=0.01)
    for t in range(steps):
        for g, lr in zip(opt2.param_groups, lrs[t], strict=True):
            g["lr"] = lr
        opt2.zero_grad()
        loss_of(m2, t).backward()
        opt2.step()
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    return lrs


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t)),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.02, total_steps=10, cycle_momentum=False
        ),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=3),
                torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
            ],
            milestones=[3],
        ),
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
    ],
    ids=["StepLR", "LambdaLR", "Cosine", "OneCycle", "Sequential", "Plateau"],
)
def test_lr_schedulers_drive_the_learning_rate(make):
    lrs = run_schedule(make)
    assert len({tuple(x) for x in lrs}) > 1  # the schedule did change the lr


def test_cyclic_momentum_schedulers_cycle_the_matrix_momentum():
    m = model()
    opt = DMuon(param_groups(m), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=10)  # cycles momentum
    seen = []
    for t in range(4):
        opt.zero_grad()
        loss_of(m, t).backward()
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["momentum"])
    assert len(set(seen)) > 1
    opt2 = DMuon(param_groups(model()), lr=0.01)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # the bookkeeping keys load back
    assert opt2.param_groups[0]["momentum"] == seen[-1]


def test_scheduler_state_survives_an_optimizer_round_trip():
    m = model()
    opt = DMuon(param_groups(m), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loss_of(m).backward()
    opt.step()
    sched.step()
    sd, ssd = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    opt2 = DMuon(param_groups(m), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    sched2.load_state_dict(ssd)
    opt2.load_state_dict(sd)  # carries 'initial_lr' (a scheduler key) back
    assert [g["lr"] for g in opt2.param_groups] == [0.005, 0.005]
    assert all("initial_lr" in g for g in opt2.param_groups)


def test_adamw_group_is_exactly_torch_adamw():
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    ours = DMuon(
        [{"params": a, "rule": "adamw"}],
        adamw_lr=0.01,
        adamw_betas=(0.8, 0.9),
        adamw_eps=1e-6,
        adamw_weight_decay=0.1,
    )
    theirs = torch.optim.AdamW(b, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for t in range(5):
        for x, y in zip(a, b, strict=True):
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(t))
            x.grad, y.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_lion_group_matches_its_equations():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 6))
    w, m = p.detach().clone(), torch.zeros(4, 6)
    opt = DMuon(
        [
            {
                "params": [p],
                "rule": "lion",
                "betas": (0.9, 0.99),
                "weight_decay": 0.1,
                "lr": 0.01,
            }
        ]
    )
    for t in range(4):
        g = torch.randn(4, 6, generator=torch.Generator().manual_seed(t))
        p.grad = g.clone()
        opt.step()
        c = 0.9 * m + 0.1 * g
        w = w * (1 - 0.01 * 0.1) - 0.01 * torch.sign(c)
        m = 0.99 * m + 0.01 * g
    assert (p.detach() - w).abs().max() < 1e-6
    assert (opt.state[p]["exp_avg"] - m).abs().max() < 1e-6


def test_sign_vote_is_used_in_the_middle_of_sign_muon():
    p = nn.Parameter(torch.randn(6, 10))
    opt = DMuon([p], rule="sign_muon", lr=0.1, ns_compute_dtype="float64")
    seen = []

    def flip(signs):
        seen.append(signs.clone())
        return -signs

    assert isinstance(flip, SignVote) and isinstance(local_vote, SignVote)
    w0 = p.detach().clone()
    g = torch.randn(6, 10)
    p.grad = g.clone()
    opt.sign_vote = flip
    opt.step()
    (signs,) = seen
    assert signs.shape == (1, 6, 10) and set(signs.unique().tolist()) <= {-1.0, 0.0, 1.0}
    # the flipped vote moves the weight the other way than the local vote would
    q = nn.Parameter(w0.clone())
    o = DMuon([q], rule="sign_muon", lr=0.1, ns_compute_dtype="float64")
    q.grad = g.clone()
    o.step()
    assert torch.allclose(p.detach() - w0, -(q.detach() - w0), atol=1e-6)


def test_bfloat16_parameters_train_with_bfloat16_state():
    m = model().to(torch.bfloat16)
    opt = DMuon(param_groups(m), lr=1e-2)
    for t in range(2):
        opt.zero_grad()
        m(
            torch.randn(8, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(t))
        ).square().mean().backward()
        opt.step()
    assert opt.state[m[0].weight]["momentum_buffer"].dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in m.parameters())
