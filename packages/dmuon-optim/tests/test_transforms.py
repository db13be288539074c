"""Transforms on their own, each against a reference computed another way (SVD)."""

import math
from typing import ClassVar

import pytest
import torch
from spectra import with_singular_values

from dmuon.optim import adjust_lr_factor, get_rule
from dmuon.optim.hyperparameters import MATRIX_KEYS
from dmuon.optim.transforms import (
    MajorityVote,
    Momentum,
    MomentumSpectralClip,
    SpectralNormalize,
    StepContext,
    TopKPolar,
    Transform,
    block_bounds,
    rank_fraction_at,
    selected_count,
)


def test_adjust_lr_conventions():
    assert adjust_lr_factor("original", 3072, 768) == 2.0
    assert adjust_lr_factor("original", 768, 3072) == 1.0
    assert math.isclose(adjust_lr_factor("match_rms_adamw", 768, 3072), 0.2 * math.sqrt(3072))
    assert adjust_lr_factor("spectral", 768, 3072) == 0.5
    assert adjust_lr_factor(None, 5, 7) == 1.0
    with pytest.raises(ValueError, match="adjust_lr must be one of"):
        adjust_lr_factor("rms", 2, 2)


def test_match_rms_adamw_gives_update_rms_0_2_for_every_shape():
    for m, n in [(64, 256), (256, 64), (128, 128)]:
        O = with_singular_values(m, n, [1.0] * min(m, n))  # exactly semi-orthogonal
        rms = (adjust_lr_factor("match_rms_adamw", m, n) * O).square().mean().sqrt()
        assert abs(rms - 0.2) < 1e-12


def test_spectral_normalize_matches_the_svd_norm():
    X = torch.sign(torch.randn(3, 7, 12, dtype=torch.float64))
    X[1] = 0  # a zero matrix stays zero
    Y = SpectralNormalize()(X, {}, StepContext(grad=X, hp={}))
    norms = torch.linalg.matrix_norm(Y, ord=2)
    assert torch.allclose(norms[[0, 2]], torch.ones(2, dtype=torch.float64), atol=1e-12)
    assert torch.equal(Y[1], torch.zeros(7, 12, dtype=torch.float64))


def test_top_k_polar_with_a_gapped_spectrum_and_little_oversampling():
    # σ = 10, 9, 8 then ≤ 1: subspace iteration with q power steps converges like
    # (σ_{k+1}/σ_k)^{2q+1} = (1/8)^5 ≈ 3e-5.
    X = with_singular_values(20, 30, [10, 9, 8] + [1.0 / (i + 1) for i in range(17)])
    hp = dict(rank_fraction=3 / 20, rank_schedule="constant", power_iters=2, oversample=0, seed=3)
    O = TopKPolar()(X[None], {}, StepContext(grad=X[None], hp=hp))[0]
    U, _, Vh = torch.linalg.svd(X)
    assert (O - U[:, :3] @ Vh[:3]).abs().max() < 1e-3


def test_top_k_polar_of_a_zero_matrix_is_zero():
    X = torch.zeros(1, 6, 9)
    hp = dict(rank_fraction=0.5, rank_schedule="constant", power_iters=1, oversample=2, seed=0)
    assert torch.equal(TopKPolar()(X, {}, StepContext(grad=X, hp=hp)), X)


def test_rank_schedules():
    hp = dict(rank_fraction=0.25, rank_start=1.0, rank_steps=4)
    assert rank_fraction_at({**hp, "rank_schedule": "constant"}, 1) == 0.25
    lin = [rank_fraction_at({**hp, "rank_schedule": "linear"}, t) for t in range(1, 7)]
    assert lin == [1.0, 0.8125, 0.625, 0.4375, 0.25, 0.25]
    cos = [rank_fraction_at({**hp, "rank_schedule": "cosine"}, t) for t in (1, 3, 5, 9)]
    assert cos[0] == 1.0 and abs(cos[1] - 0.625) < 1e-12 and cos[2] == cos[3] == 0.25


@pytest.mark.parametrize(("size", "blocks"), [(10, 3), (8, 2), (3, 5), (7, 1)])
def test_block_bounds_follow_tensor_split(size, blocks):
    expected = [
        (int(c[0]), int(c[-1]) + 1) for c in torch.arange(size).tensor_split(blocks) if len(c)
    ]
    assert block_bounds(size, blocks) == expected


def test_selected_count():
    assert [selected_count(0.25, s) for s in (1, 4, 5, 100)] == [1, 1, 2, 25]
    # the decimal the fraction prints as: 0.07 · 100 is 7.000000000000001 in binary (8)
    assert [selected_count(f, 100) for f in (0.07, 0.29, 0.57)] == [7, 29, 57]
    assert selected_count(0.071, 100) == 8


@pytest.mark.parametrize("rule", ["normuon", "adamuon", "dion3"])
def test_a_zero_row_with_eps_zero_stays_finite(rule):
    """A gradient row that is zero (a dead unit) gives a zero second moment; with
    ``eps=0`` (accepted) the normalisation divided 0 by 0 and the weights became NaN,
    a finite gradient passing every non-finite check."""
    from dmuon.optim import DMuon

    p = torch.nn.Parameter(torch.randn(6, 10, generator=torch.Generator().manual_seed(0)))
    extra = {"fraction": 1.0} if rule == "dion3" else {}
    opt = DMuon([p], rule=rule, lr=0.01, eps=0.0, **extra)
    g = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    g[2] = 0.0
    for _ in range(3):
        p.grad = g.clone()
        opt.step()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("rule", ["dion2", "dion3"])
def test_dion_selects_fp16_rows_by_their_true_l1_norm(rule):
    """An fp16 momentum of finite entries whose row sums pass 65504: the rows chosen are
    those with the largest L1 norms, as in fp32 (the fp16 sums were inf and topk broke
    the tie by position)."""
    from dmuon.optim import DMuon

    grad = (torch.randn(16, 24, generator=torch.Generator().manual_seed(1)) * 3e3).half()
    assert torch.isinf(grad.abs().sum(dim=1)).any()  # the trap is set
    extra = {"select_dim": "rows"} if rule == "dion2" else {}
    moved = {}
    for dtype in (torch.float32, torch.float16):
        p = torch.nn.Parameter(torch.zeros(16, 24, dtype=dtype))
        opt = DMuon([p], rule=rule, lr=0.1, fraction=0.25, **extra)
        p.grad = grad.to(dtype)
        opt.step()
        moved[dtype] = (p.detach().float().abs().sum(dim=1) > 0).nonzero().flatten().tolist()
    exact = sorted(grad.double().abs().sum(dim=1).topk(4).indices.tolist())
    assert moved[torch.float16] == moved[torch.float32] == exact


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_momentum_spectral_clip_against_the_svd(mode):
    # Musec's convention (issue 17): B = √min(m, n)·X/‖X‖_F, then the clip at τ; the
    # overall scale of X (here 1e-3) does not matter. test_musec.py has the wide-range case.
    sv = [6.0, 3.0, 0.5, 0.2]
    X = 1e-3 * with_singular_values(8, 4, sv)[None]
    hp = dict(clip_mode=mode, clip_tau=1.0, clip_steps=None)
    Y = MomentumSpectralClip()(X, {}, StepContext(grad=X, hp=hp))[0]
    s = torch.tensor(sv, dtype=torch.float64)
    s = s * (2.0 / s.norm())
    want = s.clamp(max=1.0) if mode == "hard" else s / torch.sqrt(1 + s**2)
    assert torch.allclose(torch.linalg.svdvals(Y), want, atol=1e-8)


def test_a_vote_must_keep_the_shape():
    X = torch.ones(1, 2, 3)
    with pytest.raises(ValueError, match="must keep the shape"):
        MajorityVote()(X, {}, StepContext(grad=X, hp={}, vote=lambda s: s[0]))


def test_rule_update_is_usable_without_an_optimizer():
    # what the distributed engine calls on an owner's stacked batch
    rule = get_rule("dion3")
    G = torch.randn(3, 8, 12, dtype=torch.float64)
    state = {
        "momentum_buffer": torch.zeros_like(G),
        "row_second_moment": torch.zeros(3, 8, dtype=torch.float64),
    }
    hp = dict(
        momentum=0.95,
        nesterov=True,
        adjust_lr="spectral",
        ns_method="gram",
        ns_coefficients="polar_express",
        ns_steps=5,
        ns_compute_dtype="float64",
        fraction=0.25,
        beta2=0.95,
        eps=1e-8,
    )
    U, scale = rule.update(G, state, hp)
    assert U.shape == G.shape and scale == math.sqrt(8 / 12)
    assert int((U.abs().sum(-1) > 0).sum()) == 3 * 2  # ⌈0.25·8⌉ = 2 rows per matrix
    assert int((state["row_second_moment"] > 0).sum()) == 3 * 2


def test_when_option_gates_every_transform_alike():
    # The gate lives in Transform.__call__: a stateful transform (Momentum) switched off
    # passes X through and leaves its state alone; switched on it is the plain transform.
    G = torch.randn(2, 3, 4, dtype=torch.float64)
    gated = Momentum(when_option="use_momentum")
    hp = {"momentum": 0.5, "nesterov": False}
    off = {"momentum_buffer": torch.ones(2, 3, 4, dtype=torch.float64)}
    out = gated(G, off, StepContext(grad=G, hp={**hp, "use_momentum": False}))
    assert out is G
    assert torch.equal(off["momentum_buffer"], torch.ones(2, 3, 4, dtype=torch.float64))
    on, plain = ({"momentum_buffer": torch.ones(2, 3, 4, dtype=torch.float64)} for _ in range(2))
    got = gated(G, on, StepContext(grad=G, hp={**hp, "use_momentum": True}))
    want = Momentum()(G, plain, StepContext(grad=G, hp=hp))
    torch.testing.assert_close(got, G + 0.5, rtol=0, atol=0)  # M ← 0.5·1 + G
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(KeyError, match="the group has no 'use_momentum'"):
        gated(G, on, StepContext(grad=G, hp=hp))
    with pytest.raises(TypeError):  # the hook is abstract: a transform must implement apply
        Transform()  # type: ignore[abstract]


def test_a_rule_refuses_two_transforms_declaring_the_same_state_name():
    from dmuon.optim import Rule
    from dmuon.optim.transforms import Momentum

    with pytest.raises(ValueError, match=r"'momentum_buffer' by Momentum, Momentum\)"):
        Rule("twice", (Momentum(), Momentum()))


def test_the_engine_asks_the_rule_whether_it_votes_mid_chain():
    from dmuon.optim import RULES, get_rule

    voting = sorted(name for name in RULES if get_rule(name).needs_collective)
    assert voting == ["sign_muon"]


def test_a_rule_refuses_a_chain_that_reads_a_key_without_a_default():
    from dataclasses import dataclass

    from dmuon.optim import Rule
    from dmuon.optim.hyperparameters import REQUIRED, Option, real
    from dmuon.optim.transforms import Orthogonalize

    @dataclass(frozen=True)
    class Radius(Transform):
        hyperparameters: ClassVar[dict[str, Option]] = {
            "radius": Option(REQUIRED, real(0.0), "ρ, no default of its own")
        }

        def apply(self, X, state, ctx):
            return X

    with pytest.raises(ValueError, match=r"rule 'no_radius': Radius reads hyperparameter 'radius'"):
        Rule("no_radius", (Orthogonalize(), Radius()))
    rule = Rule("with_radius", (Radius(),), defaults={"radius": 2})
    assert rule.reads == ("radius",)
    assert rule.options["radius"].default == 2.0  # checked, normalised to float


def test_a_switch_has_no_default_until_the_rule_gives_one():
    from dmuon.optim import Rule
    from dmuon.optim.transforms import Momentum, Sign

    with pytest.raises(ValueError, match=r"rule 'r': Sign reads hyperparameter 'sign'"):
        Rule("r", (Momentum(), Sign(when_option="sign")))
    assert (
        Rule("r", (Sign(when_option="sign"),), defaults={"sign": False}).options["sign"].default
        is False
    )
    with pytest.raises(ValueError, match=r"rule 'r': default sign must be True or False"):
        Rule("r", (Sign(when_option="sign"),), defaults={"sign": "yes"})


def test_one_switch_turns_on_several_links():
    """Two links under one ``when_option`` key: one option (before: refused at definition,
    each link declaring its own switch with its own name in the text)."""
    from dmuon.optim import Rule
    from dmuon.optim.transforms import AdjustLR, Momentum, Orthogonalize, Sign

    rule = Rule(
        "r",
        (Momentum(), Sign(when_option="sw"), Orthogonalize(when_option="sw"), AdjustLR()),
        defaults={"sw": True},
    )
    assert rule.options["sw"].default is True
    G = torch.randn(1, 4, 6)
    off = Sign(when_option="sw")(G, {}, StepContext(grad=G, hp={"sw": False}))
    on = Sign(when_option="sw")(G, {}, StepContext(grad=G, hp={"sw": True}))
    assert torch.equal(off, G) and torch.equal(on, torch.sign(G))


def test_two_inline_options_alike_but_for_their_check_say_so():
    """Two transforms each declaring ``Option(0.9, real(...), "EMA decay")`` inline: two
    check functions, so two Options; the error says that, not "0.9: EMA decay unlike 0.9:
    EMA decay"."""
    from dataclasses import dataclass

    from dmuon.optim import Rule
    from dmuon.optim.hyperparameters import Option, real

    def decay() -> dict[str, Option]:
        return {"beta3": Option(0.9, real(0.0, 1.0, hi_open=True), "EMA decay")}

    @dataclass(frozen=True)
    class T1(Transform):
        hyperparameters: ClassVar[dict[str, Option]] = decay()

        def apply(self, X, state, ctx):
            return X

    @dataclass(frozen=True)
    class T2(T1):
        hyperparameters: ClassVar[dict[str, Option]] = decay()

    with pytest.raises(ValueError, match="the same default and meaning as T1's") as err:
        Rule("r", (T1(), T2()))
    assert "declare it once at module level" in str(err.value)


def test_a_rule_refuses_two_transforms_declaring_one_key_differently():
    from dataclasses import dataclass

    from dmuon.optim import Rule
    from dmuon.optim.hyperparameters import Option, integer, real
    from dmuon.optim.transforms import RowNormalize

    @dataclass(frozen=True)
    class OtherBeta(Transform):  # beta2 as an integer: a different type
        hyperparameters: ClassVar[dict[str, Option]] = {
            "beta2": Option(1, integer(0), "not an EMA decay")
        }

        def apply(self, X, state, ctx):
            return X

    @dataclass(frozen=True)
    class OtherDefault(Transform):  # beta2 with another default
        hyperparameters: ClassVar[dict[str, Option]] = {
            "beta2": Option(0.9, real(0.0, 1.0, hi_open=True), "EMA decay")
        }

        def apply(self, X, state, ctx):
            return X

    for other in (OtherBeta(), OtherDefault()):
        name = type(other).__name__
        with pytest.raises(ValueError, match=rf"rule 'r': {name} declares hyperparameter 'beta2'"):
            Rule("r", (RowNormalize(), other))


def test_a_transform_declares_a_common_key_with_its_common_entry():
    from dataclasses import dataclass

    from dmuon.optim import Rule
    from dmuon.optim.hyperparameters import Option, real

    @dataclass(frozen=True)
    class OwnMomentum(Transform):
        hyperparameters: ClassVar[dict[str, Option]] = {
            "momentum": Option(0.9, real(0.0), "a default of its own")
        }

        def apply(self, X, state, ctx):
            return X

    with pytest.raises(ValueError, match=r"OwnMomentum declares hyperparameter 'momentum'"):
        Rule("r", (OwnMomentum(),))


def test_a_rule_refuses_a_default_for_a_key_its_chain_does_not_read():
    from dmuon.optim import Rule
    from dmuon.optim.transforms import Momentum

    with pytest.raises(ValueError, match=r"rule 'r': defaults for \['beta2'\]"):
        Rule("r", (Momentum(),), defaults={"beta2": 0.9})


def test_a_rule_refuses_a_default_for_a_common_matrix_key():
    """``momentum``/``adjust_lr`` are the constructor's keys: a rule's default for them was
    accepted, never checked and never used (a group stepped with μ = 0.95, not 0.5)."""
    from dmuon.optim import Rule
    from dmuon.optim.transforms import Momentum

    with pytest.raises(ValueError, match=r"rule 'r': defaults for \['momentum'\], common"):
        Rule("r", (Momentum(),), defaults={"momentum": 0.5})


def test_a_rule_derives_its_options_from_its_chain():
    from dmuon.optim import RULES

    for rule in RULES.values():
        declared = {k: o for t in rule.chain for k, o in t.hyperparameter_specs().items()}
        assert set(rule.options) == set(declared) - set(MATRIX_KEYS), rule.name
        for key, opt in rule.options.items():
            want = rule.defaults.get(key, declared[key].default)
            assert opt.default == want, (rule.name, key)
    assert RULES["muon2"].options["muon2_eps"].default == 1e-16  # AdamPrecondition's own
    assert "eps" not in RULES["muon2"].options  # NorMuon's eps sits outside the root
    assert "select_dim" in RULES["dion2"].options  # Dion3's row state fixes rows
    assert "select_dim" not in RULES["dion3"].options


def test_a_caller_value_wins_over_the_rule_default():
    import torch

    from dmuon.optim import DMuon

    w, v = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4, 4))
    opt = DMuon([{"params": [w]}, {"params": [v], "sign": False}], rule="adamuon")
    assert [g["sign"] for g in opt.param_groups] == [True, False]  # rule default, group value
    opt = DMuon([w], rule="adamuon", sign=False, eps=1e-6)  # the constructor's value
    assert (opt.param_groups[0]["sign"], opt.param_groups[0]["eps"]) == (False, 1e-6)
    opt = DMuon([w], rule="muon2", muon2_eps=1e-12)  # over muon2's own 1e-16
    assert opt.param_groups[0]["muon2_eps"] == 1e-12


def test_muon2s_old_eps_is_refused_naming_its_new_name():
    """Muon²'s ε was ``eps`` (inside the root, 1e-16), which NorMuon's, AdaMuon's and
    Dion3's ``eps`` (outside, 1e-8) shared: the constructor keyword and a loaded group
    that still say ``eps`` are refused, saying ``muon2_eps``."""
    import torch

    from dmuon.optim import DMuon

    w = torch.nn.Parameter(torch.ones(4, 4))
    with pytest.raises(ValueError, match="rule 'muon2' names eps muon2_eps now"):
        DMuon([w], rule="muon2", eps=1e-12)
    opt = DMuon([w], rule="muon2")
    w.grad = torch.ones(4, 4)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["eps"] = sd["param_groups"][0].pop("muon2_eps")  # an old save
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['eps'\] for rule 'muon2' \(rule"):
        opt.load_state_dict(sd)


def test_every_key_a_rule_reads_is_a_key_its_groups_have():
    import torch

    from dmuon.optim import RULES, DMuon

    for name, rule in RULES.items():
        group = DMuon([torch.nn.Parameter(torch.ones(4, 4))], rule=name).param_groups[0]
        assert set(rule.reads) <= set(group), name


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_is_the_plain_sum_form_bit_for_bit_until_it_would_overflow(nesterov):
    from dmuon.optim.transforms import Momentum, StepContext

    g = torch.Generator().manual_seed(0)
    M = torch.zeros(2, 4, 6)
    plain = torch.zeros(2, 4, 6)
    hp = {"momentum": 0.95, "nesterov": nesterov}
    for t in range(5):
        G = torch.randn(2, 4, 6, generator=g) * 10.0 ** (3 * t - 6)
        out = Momentum()(G, {"momentum_buffer": M}, StepContext(grad=G, hp=hp))
        plain = torch.add(G, plain, alpha=0.95)  # the sum form as it was, unclamped
        assert torch.equal(M, plain)
        assert torch.equal(out, torch.add(G, plain, alpha=0.95) if nesterov else plain)


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_saturates_at_the_largest_finite_value_instead_of_overflowing(nesterov):
    from dmuon.optim.transforms import Momentum, StepContext

    big = torch.finfo(torch.float32).max
    G = torch.tensor([[[1e38, -1e38, 1.0]]])
    M = torch.zeros_like(G)
    hp = {"momentum": 0.95, "nesterov": nesterov}
    for _ in range(6):  # the plain sum overflows at step 3 (Nesterov) or 4
        out = Momentum()(G, {"momentum_buffer": M}, StepContext(grad=G, hp=hp))
    assert M[0, 0, :2].tolist() == [big, -big]
    assert out[0, 0, :2].tolist() == [big, -big]
    assert torch.isfinite(out).all() and out[0, 0, 2] > 1.0  # small entries go on summing


def test_every_rule_stays_finite_on_finite_gradients_past_the_dtypes_range():
    """Gradients of ±1e38 (finite fp32) four steps running: the momentum saturates, and
    so must whatever a rule adds to it. MONA's acceleration term (``X + γ/(1−μ)·D``,
    18× the difference average) overflowed to ±inf and Newton–Schulz made the weights
    NaN from the second step."""
    from dmuon.optim import RULES, DMuon

    for rule in RULES:
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8, 16, generator=g))
        opt = DMuon([p], rule=rule, lr=0.01)
        for t in range(4):
            p.grad = 1e38 * torch.randn(8, 16, generator=g).sign()
            opt.step()
            assert torch.isfinite(p).all(), (rule, t)


def test_a_gradient_spike_does_not_freeze_muon2s_second_moment():
    """One gradient entry of 1e20 (its square is past fp32's range): Muon²'s ``V`` is
    saturated, not ``inf`` — an infinite entry stayed infinite (β₂·inf = inf), and its
    update was 0 for the rest of the run. After the spike decays, that entry moves as
    the others do."""
    from dmuon.optim import DMuon

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 16, generator=g))
    opt = DMuon([p], rule="muon2", lr=0.01, beta2=0.5)
    spike = torch.randn(8, 16, generator=g)
    spike[0, 0] = 1e20
    p.grad = spike
    opt.step()
    V = opt.state[p]["grad_second_moment"]
    assert torch.isfinite(V).all() and V[0, 0] == torch.finfo(torch.float32).max
    for _ in range(200):  # β₂ = 0.5: max · 0.5**200 is back among the others
        before = p.detach().clone()
        p.grad = torch.randn(8, 16, generator=g)
        opt.step()
    moved = (p.detach() - before).abs()
    assert moved[0, 0] > 0.1 * moved.mean(), (moved[0, 0], moved.mean())
