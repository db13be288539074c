"""Stacking is invisible: a batched step equals the per-parameter step, an expert
stack equals its matrices one by one, a conv weight is one flattened matrix of its
own, a fused QKV equals separate q, k, v — and a missing gradient touches nothing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import init_state, ns, rule_step

from dmuon.optim import RULES, DMuon

F64 = dict(ns_compute_dtype="float64", lr=0.05, weight_decay=0.1, momentum=0.9)


def run(groups, grads_fn, steps=3, **kw):
    opt = DMuon(groups, **kw)
    params = [p for g in opt.param_groups for p in g["params"]]
    for t in range(steps):
        for p, g in zip(params, grads_fn(t), strict=True):
            p.grad = g.clone()
        opt.step()
    return opt


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_batched_step_equals_per_parameter_step(rule):
    shapes = [(8, 12)] * 3 + [(12, 8)] * 2 + [(8, 12)]
    w0 = [randn(*s, seed=i) for i, s in enumerate(shapes)]

    def grads(t):
        return [randn(*s, seed=100 * t + i) for i, s in enumerate(shapes)]

    together = [torch.nn.Parameter(w.clone()) for w in w0]
    run([{"params": together}], grads, rule=rule, **F64)
    for i, w in enumerate(w0):
        alone = torch.nn.Parameter(w.clone())
        run([{"params": [alone]}], lambda t, i=i: [grads(t)[i]], rule=rule, **F64)
        # float64 throughout: batched vs single products differ only in rounding
        assert (alone.detach() - together[i].detach()).abs().max() < 1e-12


def test_batched_step_equals_per_parameter_step_in_float32():
    shapes = [(16, 48)] * 4
    w0 = [randn(*s, seed=i, dtype=torch.float32) for i, s in enumerate(shapes)]

    def grads(t):
        return [randn(*s, seed=100 * t + i, dtype=torch.float32) for i, s in enumerate(shapes)]

    kw = dict(ns_compute_dtype="float32", lr=0.02)
    together = [torch.nn.Parameter(w.clone()) for w in w0]
    run([{"params": together}], grads, **kw)
    for i, w in enumerate(w0):
        alone = torch.nn.Parameter(w.clone())
        run([{"params": [alone]}], lambda t, i=i: [grads(t)[i]], **kw)
        # fp32 rounding of 5 Gram NS steps on unit-norm matrices: ~1e-6 of the update
        assert (alone.detach() - together[i].detach()).abs().max() < 1e-5


@pytest.mark.parametrize("rule", ["muon", "normuon", "dion3", "muonbp"])
def test_expert_stack_equals_its_matrices_one_by_one(rule):
    E, m, n = 4, 6, 10
    w0 = randn(E, m, n, seed=1)

    def grads(t):
        return [randn(E, m, n, seed=10 + t)]

    stack = torch.nn.Parameter(w0.clone())
    opt = run([{"params": [stack], "flatten": False}], grads, rule=rule, **F64)
    singles = [torch.nn.Parameter(w0[e].clone()) for e in range(E)]
    opt1 = run([{"params": singles}], lambda t: list(grads(t)[0]), rule=rule, **F64)
    for e in range(E):
        assert (stack.detach()[e] - singles[e].detach()).abs().max() < 1e-12
    for key, value in opt.state[stack].items():
        if key == "step":
            continue
        expected = torch.stack([opt1.state[s][key] for s in singles])
        assert value.shape == expected.shape  # (E, m, n) or (E, m): per-parameter layout
        assert (value - expected).abs().max() < 1e-12


@pytest.mark.parametrize("rule", sorted(RULES))
def test_conv_weight_is_one_flattened_matrix_per_parameter(rule):
    # Two conv weights of the same shape share a bucket (batched) but are never
    # flattened together: each must equal the rule on its own (out, in·k·k) matrix,
    # rows = output channels (NorMuon's and Dion3's per-row state has one value per
    # output channel; a transposed flattening would pass Muon, whose update and
    # match_rms_adamw factor are symmetric in m and n, but not them).
    shape = (6, 3, 3, 3)
    w0 = [randn(*shape, seed=i) for i in range(2)]
    convs = [torch.nn.Parameter(w.clone()) for w in w0]
    hp = dict(momentum=0.9, nesterov=True, lr=0.05, weight_decay=0.1)
    hp |= dict(adjust_lr="match_rms_adamw", ns_coefficients="polar_express", ns_steps=5)
    hp |= {k: o.default for k, o in RULES[rule].options.items()}

    def grads(t):
        return [randn(*shape, seed=10 * t + i) for i in range(2)]

    opt = run([{"params": convs, "flatten": True}], grads, rule=rule, **F64)
    for i, w in enumerate(w0):
        W, st = w.reshape(6, 27).clone(), init_state(rule, 6, 27)
        for t in range(3):
            W = rule_step(rule, W, grads(t)[i].reshape(6, 27), st, hp, t + 1)
        assert (convs[i].detach().reshape(6, 27) - W).abs().max() < 1e-12
        for key, value in st.items():
            kept = opt.state[convs[i]][key]
            assert kept.shape == (shape if value.dim() == 2 else shape[:1]), key
            assert (kept.reshape(value.shape) - value).abs().max() < 1e-12, key


@pytest.mark.parametrize(
    "sizes", [(8, 8, 8), (8, 4, 4)], ids=["equal (one bucket)", "unequal (gathered)"]
)
@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_fused_qkv_equals_separate_projections(sizes, rule):
    n = 8
    w0 = randn(sum(sizes), n, seed=3)

    def grads(t):
        return [randn(sum(sizes), n, seed=30 + t)]

    fused = torch.nn.Parameter(w0.clone())
    opt = run([{"params": [fused], "split_sizes": sizes}], grads, rule=rule, **F64)
    parts = [torch.nn.Parameter(w.clone()) for w in w0.split(sizes)]
    opt1 = run([{"params": parts}], lambda t: list(grads(t)[0].split(sizes)), rule=rule, **F64)
    assert (fused.detach() - torch.cat([p.detach() for p in parts])).abs().max() < 1e-12
    for key, value in opt.state[fused].items():
        if key != "step":
            expected = torch.cat([opt1.state[p][key] for p in parts])
            assert value.shape == expected.shape and (value - expected).abs().max() < 1e-12


def test_num_heads_equals_one_matrix_per_head():
    H, d, n = 4, 3, 10
    w0 = randn(H * d, n, seed=5)

    def grads(t):
        return [randn(H * d, n, seed=50 + t)]

    whole = torch.nn.Parameter(w0.clone())
    run([{"params": [whole], "num_heads": H}], grads, **F64)
    heads = [torch.nn.Parameter(w.clone()) for w in w0.split(d)]
    run([{"params": heads}], lambda t: list(grads(t)[0].split(d)), **F64)
    assert (whole.detach() - torch.cat([h.detach() for h in heads])).abs().max() < 1e-12


def test_split_and_heads_together():
    # GQA-like fused projection: q has 4 heads of 2 rows, k and v 2 heads each.
    sizes, heads, n = (8, 4, 4), (4, 2, 2), 6
    w0 = randn(16, n, seed=7)

    def grads(t):
        return [randn(16, n, seed=70 + t)]

    fused = torch.nn.Parameter(w0.clone())
    run([{"params": [fused], "split_sizes": sizes, "num_heads": heads}], grads, **F64)
    singles = [torch.nn.Parameter(w.clone()) for w in w0.split(2)]
    run([{"params": singles}], lambda t: list(grads(t)[0].split(2)), **F64)
    assert (fused.detach() - torch.cat([s.detach() for s in singles])).abs().max() < 1e-12


@pytest.mark.parametrize("rule", ["mona", "muonbp", "numuon"])
def test_matrices_at_different_step_counts_share_a_bucket(rule):
    # Rules that read the step count run each count as its own batch.
    shape, kw = (6, 10), dict(F64, period=2) if rule == "muonbp" else F64
    w0 = [randn(*shape, seed=i) for i in range(3)]
    history = {0: [0, 1, 2, 3], 1: [1, 3], 2: [0, 2, 3]}  # steps at which each has a grad
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = DMuon([{"params": params}], rule=rule, **kw)
    for t in range(4):
        for i, p in enumerate(params):
            p.grad = randn(*shape, seed=10 * t + i) if t in history[i] else None
        opt.step()
    for i, w in enumerate(w0):
        alone = torch.nn.Parameter(w.clone())
        o = DMuon([{"params": [alone]}], rule=rule, **kw)
        for t in history[i]:
            alone.grad = randn(*shape, seed=10 * t + i)
            o.step()
        assert (alone.detach() - params[i].detach()).abs().max() < 1e-12


@pytest.mark.parametrize("rule", sorted(RULES))
def test_parameter_without_grad_is_skipped_and_its_state_untouched(rule):
    shapes = [(6, 10)] * 3
    w0 = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = DMuon(
        [{"params": params}], rule=rule, weight_decay=0.1, **{"ns_compute_dtype": "float64"}
    )
    for t in range(2):  # every parameter steps twice
        for i, p in enumerate(params):
            p.grad = randn(*shapes[i], seed=10 * t + i)
        opt.step()
    frozen = {k: v.clone() for k, v in opt.state[params[1]].items()}
    w_frozen = params[1].detach().clone()
    params[1].grad = None  # now only 0 and 2 have gradients
    for i in (0, 2):
        params[i].grad = randn(*shapes[i], seed=99 + i)
    opt.step()
    assert torch.equal(params[1].detach(), w_frozen)
    for k, v in opt.state[params[1]].items():
        assert torch.equal(v, frozen[k]), k
    assert opt.state[params[0]]["step"].item() == 3
    # and the others got the step they would get alone (their own history)
    for i in (0, 2):
        alone = torch.nn.Parameter(w0[i].clone())
        o = DMuon([{"params": [alone]}], rule=rule, weight_decay=0.1, ns_compute_dtype="float64")
        for g in [
            randn(*shapes[i], seed=i),
            randn(*shapes[i], seed=10 + i),
            randn(*shapes[i], seed=99 + i),
        ]:
            alone.grad = g
            o.step()
        assert (alone.detach() - params[i].detach()).abs().max() < 1e-12


def test_zero_gradient_gives_pure_weight_decay_and_no_nan():
    p = torch.nn.Parameter(torch.ones(4, 6))
    opt = DMuon([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(4, 6)
    opt.step()
    assert torch.equal(p.detach(), torch.full((4, 6), 1 - 0.1 * 0.5))


def test_reference_ns_is_the_polar_factor():
    # sanity of the test helper itself: 5 Polar Express steps in float64 land in its band
    G = randn(8, 20, seed=0)
    sv = torch.linalg.svdvals(ns(G))
    assert sv.min() > 0.7 and sv.max() < 1.14


@pytest.mark.parametrize("rule", ["muon", "dion3", "muonbp", "numuon", "sign_muon"])
def test_how_a_bucket_is_cut_into_calls_changes_nothing(rule):
    shapes = [(6, 10)] * 5 + [(10, 6)] * 2
    w0 = [randn(*s, seed=i) for i, s in enumerate(shapes)]

    def grads(t):
        # parameter 2 has no gradient at step 1: the chunks are not consecutive then
        return [
            None if (t == 1 and i == 2) else randn(*s, seed=10 * t + i)
            for i, s in enumerate(shapes)
        ]

    results = []
    for limit in (None, 1, 2 * 60, 1 << 62):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = DMuon([{"params": params}], rule=rule, **F64)
        opt.max_batch_elements = limit
        for t in range(3):
            for p, g in zip(params, grads(t), strict=True):
                p.grad = g
            opt.step()
        results.append(torch.cat([p.detach().flatten() for p in params]))
    for r in results[1:]:
        assert (r - results[0]).abs().max() < 1e-12


def test_an_owner_filter_buckets_only_the_owned_matrices():
    # What the distributed engine does on one owner: bucket the matrices it owns,
    # run the same rule with the same functions, get the single-process result.
    from dmuon.optim import build_buckets, get_rule, step_bucket

    shapes = [(6, 10)] * 4 + [(10, 6)] * 2
    w0 = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    grads = [randn(*s, seed=50 + i) for i, s in enumerate(shapes)]
    reference = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = DMuon([{"params": reference}], rule="normuon", **F64)
    for p, g in zip(reference, grads, strict=True):
        p.grad = g.clone()
    opt.step()

    owned = {0, 3, 5}
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    group = {**opt.param_groups[0], "params": params}
    buckets, state = build_buckets(
        group, get_rule("normuon"), lambda p: {}, str, include=lambda i, p: i in owned
    )
    assert set(map(id, state)) == {id(params[i]) for i in owned}
    assert sorted(e.index for b in buckets for e in b.entries) == sorted(owned)
    for i in owned:
        params[i].grad = grads[i].clone()
        state[params[i]]["step"] += 1
    for b in buckets:
        step_bucket(b, group, get_rule("normuon"), state)
    for i in owned:
        assert (params[i].detach() - reference[i].detach()).abs().max() < 1e-12


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), max_size=12), limit=st.integers(1, 40))
def test_batch_runs_cut_greedily_in_order(sizes, limit):
    """``batch_runs`` (the engine's batching, the planner's count of calls) cuts the
    indices in order into runs within ``limit``, each as long as it can be: a run ends
    only where the next entry would overflow it, and an entry over ``limit`` stands
    alone."""
    from dmuon.optim.batches import batch_runs

    runs = batch_runs(sizes, limit)
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    assert all(run for run in runs)
    for k, run in enumerate(runs):
        total = sum(sizes[i] for i in run)
        assert total <= limit or len(run) == 1
        if k + 1 < len(runs):
            assert total + sizes[runs[k + 1][0]] > limit
