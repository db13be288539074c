"""Cautious weight decay against a re-statement of its equation.

Chen et al., *Cautious Weight Decay*, arXiv 2510.12402, eq. for a decoupled optimizer:
``x ← x − η(u + λ·𝟙[u⊙x ≥ 0]⊙x)``; in DMuon's convention ``u = s·U`` and
``W ← W − lr·wd·𝟙[U⊙W ≥ 0]⊙W − lr·s·U``. Checked in float64 element by element, and
on a whole DMuon step against the plain step's update.
"""

import pytest
import torch

from dmuon.optim import DMuon, apply_update, param_groups


def restated(W, U, lr, wd, scale):
    """The equation entry by entry, in float64."""
    out = W.double().clone()
    for i in range(W.numel()):
        w, u = float(W.view(-1)[i]), float(U.view(-1)[i])
        decay = lr * wd * w if u * w >= 0 else 0.0
        out.view(-1)[i] = w - decay - lr * scale * u
    return out


def test_apply_update_restates_the_equation_with_ties_and_zeros():
    g = torch.Generator().manual_seed(0)
    W, U = torch.randn(6, 7, generator=g), torch.randn(6, 7, generator=g)
    W[0, :3] = 0.0  # u·0 = 0 ≥ 0: decayed (by nothing)
    U[1, :3] = 0.0  # 0·w = 0 ≥ 0: decayed
    expected = restated(W, U, 0.1, 0.3, 2.0)
    got = [W.clone()]
    apply_update(got, [U], lr=0.1, weight_decay=0.3, scale=2.0, cautious=True)
    torch.testing.assert_close(got[0].double(), expected, rtol=0, atol=1e-6)
    plain = [W.clone()]
    apply_update(plain, [U], lr=0.1, weight_decay=0.3, scale=2.0)
    agree = (U * W) >= 0
    assert not torch.equal(plain[0], got[0]) and bool(agree.any()) and not bool(agree.all())


def test_a_dmuon_step_decays_where_the_update_agrees_with_the_weight():
    """Two optimizers on the same weights and gradient: wd = 0 gives the update
    ``Δ = −lr·s·U``; cautious decay must give ``W − lr·wd·𝟙[U⊙W ≥ 0]⊙W + Δ``."""
    lr, wd = 0.05, 0.4
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 5)))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plain = DMuon(param_groups(models[0]), lr=lr, ns_compute_dtype="float32")
    cautious = DMuon(
        param_groups(models[1]),
        lr=lr,
        weight_decay=wd,
        cautious_weight_decay=True,
        ns_compute_dtype="float32",
    )
    before = [layer.weight.detach().clone() for layer in models[0]]
    for m, opt in zip(models, (plain, cautious), strict=True):
        m(x).square().mean().backward()
        opt.step()
    for i, start in enumerate(before):
        delta = models[0][i].weight.detach() - start  # the plain step: −lr·s·U
        mask = ((-delta) * start) >= 0  # 𝟙[U⊙W ≥ 0]
        expected = start - lr * wd * mask * start + delta
        torch.testing.assert_close(models[1][i].weight.detach(), expected, rtol=0, atol=1e-6)
        assert 0 < int(mask.sum()) < mask.numel(), "the mask is all or nothing: no test"


def test_the_option_is_checked_and_is_a_group_key():
    w = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="cautious_weight_decay"):
        DMuon([w], cautious_weight_decay="yes")
    opt = DMuon([{"params": [w], "cautious_weight_decay": True}])
    assert opt.param_groups[0]["cautious_weight_decay"] is True
    assert (
        DMuon([torch.nn.Parameter(torch.zeros(3, 3))]).param_groups[0]["cautious_weight_decay"]
        is False
    )


def test_adamw_and_lion_restate_the_equation_in_float64():
    """AdamW: ``u = m̂/(√v̂ + ε)``; Lion: ``u = sign(β₁m + (1−β₁)g)``; both
    ``W ← W − lr·(u + wd·𝟙[u⊙W ≥ 0]⊙W)``, over 3 steps, element by element."""
    from dmuon.optim import adamw_step, lion_step

    lr, wd, (b1, b2), eps = 0.05, 0.3, (0.9, 0.95), 1e-8
    g = torch.Generator().manual_seed(2)
    start = torch.randn(40, generator=g, dtype=torch.float64)
    grads = [torch.randn(40, generator=g, dtype=torch.float64) for _ in range(3)]

    W, t = start.clone(), torch.zeros(())
    m, v = torch.zeros(40, dtype=torch.float64), torch.zeros(40, dtype=torch.float64)
    for grad in grads:
        adamw_step([W], [grad], [m], [v], [t], lr=lr, betas=(b1, b2), eps=eps,
                   weight_decay=wd, cautious=True)  # fmt: skip
    want, mm, vv = start.tolist(), [0.0] * 40, [0.0] * 40
    for step, grad in enumerate(grads, start=1):
        for i, gi in enumerate(grad.tolist()):
            mm[i] = b1 * mm[i] + (1 - b1) * gi
            vv[i] = b2 * vv[i] + (1 - b2) * gi * gi
            u = (mm[i] / (1 - b1**step)) / ((vv[i] / (1 - b2**step)) ** 0.5 + eps)
            decay = wd * want[i] if u * want[i] >= 0 else 0.0
            want[i] -= lr * (u + decay)
    torch.testing.assert_close(W, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)

    W, m, t = start.clone(), torch.zeros(40, dtype=torch.float64), torch.zeros(())
    for grad in grads:
        lion_step([W], [grad], [m], [t], lr=lr, betas=(b1, b2), weight_decay=wd, cautious=True)
    want, mm = start.tolist(), [0.0] * 40
    for grad in grads:
        for i, gi in enumerate(grad.tolist()):
            c = b1 * mm[i] + (1 - b1) * gi
            u = (c > 0) - (c < 0)
            decay = wd * want[i] if u * want[i] >= 0 else 0.0
            want[i] -= lr * (u + decay)
            mm[i] = b2 * mm[i] + (1 - b2) * gi
    torch.testing.assert_close(W, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_the_flag_reaches_every_group():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = DMuon(param_groups(model), cautious_weight_decay=True, adamw_weight_decay=0.1)
    assert all(g["cautious_weight_decay"] is True for g in opt.param_groups)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # AdamW's cautious path on the norm and the bias


def test_a_dmuon_pickled_before_the_key_existed_loads_without_it():
    """An optimizer pickled by an earlier release has no ``cautious_weight_decay`` in its
    saved defaults nor in its groups: it unpickles with the flag off and steps."""
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    state = DMuon(param_groups(model)).__getstate__()
    config = copy.deepcopy(state["dmuon_config"])
    for key in ("matrix_defaults", "scalar_defaults"):
        del config[key]["cautious_weight_decay"]
    key = "cautious_weight_decay"
    groups = [{k: v for k, v in g.items() if k != key} for g in state["param_groups"]]
    old = DMuon.__new__(DMuon)
    old.__setstate__({**state, "dmuon_config": config, "param_groups": groups})
    assert all(g["cautious_weight_decay"] is False for g in old.param_groups)
    model(torch.randn(2, 4)).sum().backward()
    old.step()
