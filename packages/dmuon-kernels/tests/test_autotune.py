"""The backend rule and the per-shape autotuner, with stand-ins for the GPU, the clock
and the kernels.

Nothing here measures real time: a virtual clock advances by a cost each stand-in
product charges, and the timer reads that clock. Candidates are SymmetricOps built
from the torch products (a correct one, a wrong one, one that raises).
"""

import json
import logging
import warnings

import pytest
import torch
from tritonref import COMPILED, DEVICE

from dmuon.kernels import (
    MIN_TRITON_SIZE,
    TORCH_OPS,
    Autotuner,
    SymmetricOps,
    cross_check_error,
    orthogonalize,
    resolve_backend,
)
from dmuon.kernels.dispatch import random_wide_batch
from dmuon.kernels.gram_newton_schulz import gram_newton_schulz_iterations
from dmuon.kernels.symmetric_ops import sym_mul_torch, sym_poly_torch, syrk_torch

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SCHEDULE = ((3.4445, -4.7750, 2.0315),) * 5


class VirtualClock:
    """Time that passes only when a stand-in product says so."""

    def __init__(self):
        self.now = 0.0
        self.timed = 0  # how many times the timer was used

    def timer(self, fn):
        self.timed += 1
        start = self.now
        fn()
        return self.now - start


def charging(name, clock, cost, wrong=False, raises=False):
    """SymmetricOps computing the torch products and charging `cost` per product."""

    def syrk(X):
        if raises:
            raise RuntimeError("out of shared memory")
        clock.now += cost
        return syrk_torch(X) * (2.0 if wrong else 1.0)

    def sym_poly(A, b, c, a):
        clock.now += cost
        return sym_poly_torch(A, b, c, a)

    def sym_mul(A, B, a):
        clock.now += cost
        return sym_mul_torch(A, B, a)

    return SymmetricOps(name, syrk, sym_poly, sym_mul)


def iterate(X, ops):
    return gram_newton_schulz_iterations(X, SCHEDULE, (2,), ops)


def make_tuner(tmp_path, clock, **kw):
    kw.setdefault("versions", (("dmuon-kernels", "1"), ("torch", "2"), ("triton", "3")))
    return Autotuner(
        timer=clock.timer, cache_dir=tmp_path, device_name=lambda d: "Fake H100 sm90", **kw
    )


def sample():
    return random_wide_batch(2, 16, 48, torch.float32, CPU)


# -- the backend rule ------------------------------------------------------------------


def never(*_):
    raise AssertionError("Triton availability must not be consulted here")


def test_auto_off_cuda_is_torch_without_asking_for_triton():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        got = resolve_backend(
            "auto", device=CPU, compute_dtype=dtype, gram_size=4096, triton_ok=never
        )
        assert got == "torch"


def test_auto_on_cuda_tunes_only_when_triton_can_help():
    def rule(**kw):
        args = dict(device=CUDA, compute_dtype=torch.float16, gram_size=1024)
        args.update(kw)
        return resolve_backend("auto", triton_ok=args.pop("triton_ok", lambda: True), **args)

    assert rule() == "tune"
    assert rule(compute_dtype=torch.float64, triton_ok=never) == "torch"
    assert rule(gram_size=MIN_TRITON_SIZE - 1, triton_ok=never) == "torch"  # below one tile
    assert rule(gram_size=MIN_TRITON_SIZE) == "tune"
    assert rule(triton_ok=lambda: False) == "torch"  # Triton missing: torch, silently


def test_forced_backends():
    kw = dict(device=CPU, compute_dtype=torch.float32, gram_size=8, triton_ok=never)
    assert resolve_backend("torch", **kw) == "torch"
    pytest.importorskip("dmuon.kernels.triton")
    if COMPILED:
        with pytest.raises(
            ValueError, match=r"backend='triton' needs a CUDA tensor, got one on cpu"
        ):
            resolve_backend("triton", **kw)
    else:  # Triton's interpreter runs the kernels on CPU tensors
        assert resolve_backend("triton", **kw) == "triton"
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\)"):
        resolve_backend("cublas", **kw)


def test_auto_on_cpu_emits_no_warning_and_no_log(caplog):
    caplog.set_level(logging.DEBUG, logger="dmuon.kernels")
    G = torch.randn(3, 96, 200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = orthogonalize(G)
    assert torch.equal(a, orthogonalize(G, backend="torch"))
    assert caplog.records == []


def test_bad_backend_value_raises():
    with pytest.raises(ValueError, match=r"backend must be one of .* got 'fast'"):
        orthogonalize(torch.randn(4, 8), backend="fast")
    with pytest.raises(ValueError, match=r"cuda_graph must be None, True or False, got 'yes'"):
        orthogonalize(torch.randn(4, 8), cuda_graph="yes")


# -- keys ------------------------------------------------------------------------------


def test_key_names_gpu_problem_dtype_and_versions(tmp_path):
    tuner = make_tuner(tmp_path, VirtualClock())
    key = tuner.key(CUDA, "gram", 4, 1024, 4096, torch.float16, 5, (2,))
    text = str(key)
    for part in ("Fake H100 sm90", "gram", "B=4", "1024x4096", "float16", "steps=5"):
        assert part in text
    assert "torch=2" in text and "triton=3" in text and "dmuon-kernels=1" in text
    others = [
        tuner.key(CUDA, "standard", 4, 1024, 4096, torch.float16, 5, (2,)),
        tuner.key(CUDA, "gram", 8, 1024, 4096, torch.float16, 5, (2,)),
        tuner.key(CUDA, "gram", 4, 1024, 14336, torch.float16, 5, (2,)),
        tuner.key(CUDA, "gram", 4, 1024, 4096, torch.bfloat16, 5, (2,)),
        tuner.key(CUDA, "gram", 4, 1024, 4096, torch.float16, 6, (2,)),
        tuner.key(CUDA, "gram", 4, 1024, 4096, torch.float16, 5, (2, 4)),
        make_tuner(tmp_path, VirtualClock(), versions=(("torch", "9"),)).key(
            CUDA, "gram", 4, 1024, 4096, torch.float16, 5, (2,)
        ),
    ]
    assert len({text, *map(str, others)}) == 1 + len(others)


# -- choosing --------------------------------------------------------------------------


def test_fastest_correct_candidate_wins(tmp_path):
    clock = VirtualClock()
    tuner = make_tuner(tmp_path, clock)
    torch_like = charging("torch", clock, 3.0)
    candidates = {"slow": charging("slow", clock, 5.0), "fast": charging("fast", clock, 1.0)}
    key = tuner.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    ops = tuner.choose(key, iterate, candidates, sample, reference=torch_like)
    assert ops.name == "fast"
    decision = tuner.lookup(key)
    assert decision.rejected == {}
    assert decision.seconds["fast"] < decision.seconds["torch"] < decision.seconds["slow"]


def test_torch_wins_when_it_is_fastest(tmp_path):
    clock = VirtualClock()
    tuner = make_tuner(tmp_path, clock)
    key = tuner.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    ops = tuner.choose(
        key,
        iterate,
        {"triton": charging("triton", clock, 2.0)},
        sample,
        reference=charging("torch", clock, 1.0),
    )
    assert ops.name == "torch"


def test_a_fast_but_wrong_candidate_is_rejected(tmp_path):
    clock = VirtualClock()
    tuner = make_tuner(tmp_path, clock)
    candidates = {
        "wrong": charging("wrong", clock, 0.1, wrong=True),
        "good": charging("good", clock, 1.0),
        "broken": charging("broken", clock, 0.01, raises=True),
    }
    key = tuner.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    ops = tuner.choose(key, iterate, candidates, sample, reference=charging("torch", clock, 2.0))
    assert ops.name == "good"
    decision = tuner.lookup(key)
    assert set(decision.rejected) == {"wrong", "broken"}
    assert "cross-check error" in decision.rejected["wrong"]
    assert "raised RuntimeError: out of shared memory" in decision.rejected["broken"]
    assert set(decision.seconds) == {"torch", "good"}  # rejected ones are never timed


def test_cross_check_error_catches_one_wrong_tile_and_non_finite_values():
    ref = torch.randn(1, 256, 256)
    wrong = ref.clone()
    wrong[0, 64:128, :64] *= 1.5  # one 64×64 tile off
    assert cross_check_error(wrong, ref) > 0.1
    nan = ref.clone()
    nan[0, 3, 3] = float("nan")
    assert cross_check_error(nan, ref) == float("inf")
    assert cross_check_error(ref, ref) == 0.0


def test_second_choice_is_remembered_in_memory(tmp_path):
    clock = VirtualClock()
    tuner = make_tuner(tmp_path, clock)
    key = tuner.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    candidates = {"fast": charging("fast", clock, 1.0)}
    reference = charging("torch", clock, 2.0)
    tuner.choose(key, iterate, candidates, sample, reference=reference)
    timed = clock.timed

    def no_sample():
        raise AssertionError("a remembered key must not be re-tuned")

    assert tuner.choose(key, iterate, candidates, no_sample, reference=reference).name == "fast"
    assert clock.timed == timed


def test_decisions_round_trip_through_the_disk_cache(tmp_path):
    clock = VirtualClock()
    first = make_tuner(tmp_path, clock)
    key = first.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    candidates = {
        "fast": charging("fast", clock, 1.0),
        "wrong": charging("wrong", clock, 0.1, wrong=True),
    }
    first.choose(key, iterate, candidates, sample, reference=charging("torch", clock, 2.0))
    data = json.loads(first.cache_file.read_text())
    assert data["format"] == 1 and data["entries"][str(key)]["winner"] == "fast"
    assert "wrong" in data["entries"][str(key)]["rejected"]

    # A new process (new tuner, same directory) reads the decision and never times.
    fresh_clock = VirtualClock()
    second = make_tuner(tmp_path, fresh_clock)
    ops = second.choose(
        second.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,)),
        iterate,
        {"fast": charging("fast", fresh_clock, 1.0)},
        lambda: pytest.fail("must not re-tune"),
    )
    assert ops.name == "fast" and fresh_clock.timed == 0

    # Other library versions: the decision does not apply, tune again, keep both entries.
    third_clock = VirtualClock()
    third = make_tuner(tmp_path, third_clock, versions=(("torch", "3"),))
    third.choose(
        third.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,)),
        iterate,
        {"fast": charging("fast", third_clock, 1.0)},
        sample,
        reference=charging("torch", third_clock, 2.0),
    )
    assert third_clock.timed == 2
    assert len(json.loads(first.cache_file.read_text())["entries"]) == 2


def test_unreadable_cache_file_is_ignored_and_replaced(tmp_path, caplog):
    clock = VirtualClock()
    tuner = make_tuner(tmp_path, clock)
    tuner.cache_file.write_text("{not json")
    key = tuner.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    assert tuner.lookup(key) is None
    tuner.choose(key, iterate, {}, sample)
    assert json.loads(tuner.cache_file.read_text())["entries"][str(key)]["winner"] == "torch"
    assert "ignoring unreadable autotune cache" in caplog.text


def test_clear_forgets_memory_and_optionally_the_file(tmp_path):
    clock = VirtualClock()
    tuner = make_tuner(tmp_path, clock)
    key = tuner.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    tuner.choose(key, iterate, {}, sample)
    tuner.clear()
    assert tuner.lookup(key) is not None  # still on disk
    tuner.clear(disk=True)
    assert not tuner.cache_file.exists() and tuner.lookup(key) is None


def test_memory_only_tuner_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clock = VirtualClock()
    tuner = Autotuner(timer=clock.timer, cache_dir=None, device_name=lambda d: "gpu")
    key = tuner.key(CUDA, "gram", 2, 16, 48, torch.float32, 5, (2,))
    tuner.choose(key, iterate, {}, sample)
    assert tuner.cache_file is None and list(tmp_path.iterdir()) == []
    assert tuner.lookup(key).winner == "torch"


def test_cache_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_KERNELS_CACHE_DIR", str(tmp_path / "here"))
    tuner = Autotuner(timer=VirtualClock().timer, device_name=lambda d: "gpu")
    assert tuner.cache_file.parent == tmp_path / "here"


# -- auto end to end, with the GPU and the clock replaced ------------------------------


def test_auto_tunes_once_per_shape_and_runs_the_winner(tmp_path, monkeypatch):
    """orthogonalize(backend="auto") as on a GPU: the rule says "tune", the tuner times
    the real Triton candidates (interpreted) against torch with a virtual clock that
    makes Triton faster, and the call then runs with the winner."""
    pytest.importorskip("dmuon.kernels.triton")
    import dmuon.kernels.dispatch as dispatch

    clock = VirtualClock()
    costs = {"torch": 2.0, "triton": 1.0, "triton_syrk": 1.5}

    def timer(fn):
        clock.timed += 1
        fn()
        return costs[timer.current]

    tuner = Autotuner(timer=timer, cache_dir=tmp_path, device_name=lambda d: "Fake GPU")
    chosen = []
    real_choose = tuner.choose

    def choose(key, iterate, candidates, make_sample, reference=TORCH_OPS):
        # label timings by the ops the timed function uses
        def labelled(X, ops):
            timer.current = ops.name
            return iterate(X, ops)

        ops = real_choose(key, labelled, candidates, make_sample, reference)
        chosen.append(ops.name)
        return ops

    tuner.choose = choose
    monkeypatch.setattr(dispatch, "default_autotuner", lambda: tuner)
    monkeypatch.setattr(dispatch, "resolve_backend", lambda *a, **k: "tune")

    G = torch.randn(2, 64, 96, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = orthogonalize(G, compute_dtype=torch.float32)
    assert chosen == ["triton"] and clock.timed == 3
    torch.testing.assert_close(
        out, orthogonalize(G, compute_dtype=torch.float32, backend="triton"), rtol=0, atol=0
    )
    orthogonalize(G, compute_dtype=torch.float32)
    assert clock.timed == 3  # same shape: remembered
    orthogonalize(torch.randn(64, 80, device=DEVICE), compute_dtype=torch.float32)
    assert clock.timed == 6  # a new shape is tuned


def test_without_autotuning_takes_the_torch_products_untimed(monkeypatch):
    """Inside without_autotuning(), "auto" where the rule says "tune" (as on a GPU) runs
    the torch products and never asks the autotuner, whose timing differs per process;
    outside, and after the context, it asks again. An explicit backend is honoured."""
    import dmuon.kernels.dispatch as dispatch
    from dmuon.kernels.dispatch import autotuning_allowed, without_autotuning

    asked = []
    other = SymmetricOps(
        "float64",
        lambda X: syrk_torch(X.double()).to(X.dtype),
        lambda A, b, c, a=0.0: sym_poly_torch(A.double(), b, c, a).to(A.dtype),
        lambda A, B, a: sym_mul_torch(A.double(), B.double(), a).to(A.dtype),
    )

    def tuned(G, plan):
        asked.append(tuple(G.shape))
        return other

    monkeypatch.setattr(dispatch, "_tuned_ops", tuned)
    monkeypatch.setattr(dispatch, "resolve_backend", lambda b, **k: "tune" if b == "auto" else b)
    G = torch.randn(3, 40, 72, generator=torch.Generator().manual_seed(4))
    kw = dict(compute_dtype=torch.float32)
    reference = orthogonalize(G, backend="torch", **kw)
    with without_autotuning():
        with without_autotuning():  # nests
            assert not autotuning_allowed()
        assert not autotuning_allowed()
        pinned = orthogonalize(G, **kw)
    assert asked == [] and autotuning_allowed()
    assert torch.equal(pinned, reference)  # the torch products, bit for bit
    tuned_out = orthogonalize(G, **kw)
    assert asked == [(3, 40, 72)]
    assert not torch.equal(tuned_out, reference)  # the stand-in rounds otherwise
