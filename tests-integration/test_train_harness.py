"""The training harness shared by benchmarks/train.py, the demo and the distributed
tests (benchmarks/common): corpus split, deterministic and shardable batches, the
byte-level GPT, the optimizer conventions, and train.py end to end."""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from benchmarks.common import (
    GPT,
    BatchSampler,
    DMuonUnavailableError,
    GPTConfig,
    build_optimizer,
    hidden_matrix_names,
    load_corpus,
    lr_multiplier,
    require_dmuon,
    shard_rows,
    steps_to_reach,
    train,
    validation_batches,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- corpus ----


def _write_tree(root, names):
    for name in names:
        i = NAMES.index(name)  # the content depends on the name, not on the writing order
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# file {name}\nMARKER_{i:03d} = {i}\n" * 3)


def _held_out_by_formula(relative, fraction):
    # The documented rule restated: first 8 bytes of sha256(path) as a fraction of 2**64.
    u = int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big")
    return u < fraction * 2**64


NAMES = [f"pkg{i % 4}/mod_{i:02d}.py" for i in range(60)]


def test_split_is_by_file_disjoint_and_follows_the_path_hash(tmp_path):
    _write_tree(tmp_path, NAMES)
    corpus = load_corpus(tmp_path, val_fraction=0.2)
    assert corpus.split == "by_file"
    assert set(corpus.train_files).isdisjoint(corpus.val_files)
    assert sorted(corpus.train_files + corpus.val_files) == sorted(NAMES)
    assert set(corpus.val_files) == {n for n in NAMES if _held_out_by_formula(n, 0.2)}
    # Each file's bytes land on its side only (every file carries unique markers).
    train_text, val_text = bytes(corpus.train.tolist()), bytes(corpus.val.tolist())
    for i, name in enumerate(NAMES):
        marker = f"MARKER_{i:03d}".encode()
        assert (marker in val_text) == (name in corpus.val_files)
        assert (marker in train_text) == (name in corpus.train_files)


def test_split_does_not_depend_on_creation_order_or_folder(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write_tree(a, NAMES)
    _write_tree(b, list(reversed(NAMES)))
    ca, cb = load_corpus(a, val_fraction=0.2), load_corpus(b, val_fraction=0.2)
    assert ca.val_files == cb.val_files and ca.train_files == cb.train_files
    assert ca.digest == cb.digest
    assert torch.equal(ca.train, cb.train) and torch.equal(ca.val, cb.val)


def test_default_corpus_is_the_stdlib_held_out_by_file():
    corpus = load_corpus()
    assert corpus.split == "by_file"
    assert all(f.endswith(".py") for f in corpus.train_files + corpus.val_files)
    assert not any("site-packages" in f for f in corpus.train_files + corpus.val_files)
    assert set(corpus.train_files).isdisjoint(corpus.val_files)
    share = len(corpus.val_files) / (len(corpus.train_files) + len(corpus.val_files))
    assert 0.03 < share < 0.15  # 8% expected; the hash makes it binomial around that
    assert corpus.train.dtype == torch.uint8 and corpus.train.numel() > 1_000_000


def test_a_single_file_is_split_by_position(tmp_path):
    path = tmp_path / "one.txt"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    corpus = load_corpus(path, val_fraction=0.1)
    cut = len(data) - int(len(data) * 0.1)
    assert corpus.split == "by_position"
    assert bytes(corpus.train.tolist()) == data[:cut]
    assert bytes(corpus.val.tolist()) == data[cut:]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"val_fraction": 0.0}, "val_fraction"), ({"val_fraction": 0.7}, "val_fraction")],
)
def test_bad_corpus_arguments_are_named(tmp_path, kwargs, match):
    _write_tree(tmp_path, NAMES)
    with pytest.raises(ValueError, match=match):
        load_corpus(tmp_path, **kwargs)


def test_missing_path_and_empty_folder_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "x.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="no file"):
        load_corpus(tmp_path)


# --------------------------------------------------------------- batches ----


def _data(n=5000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).to(
        torch.uint8
    )


def test_sampler_is_a_pure_function_of_seed_and_step():
    data = _data()
    a, b = BatchSampler(data, 8, 32, seed=5), BatchSampler(data, 8, 32, seed=5)
    torch.manual_seed(123)  # the global RNG plays no part
    xa, ya = a.batch(17)
    torch.manual_seed(999)
    xb, yb = b.batch(17)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batch(18)[0], xa)
    assert not torch.equal(BatchSampler(data, 8, 32, seed=6).batch(17)[0], xa)


def test_batches_are_windows_of_the_data_with_next_byte_targets():
    data = _data()
    sampler = BatchSampler(data, 6, 20, seed=1)
    x, y = sampler.batch(3)
    raw = bytes(data.tolist())
    assert x.dtype == torch.int64 and x.shape == (6, 20) == y.shape
    for row, start in enumerate(sampler.offsets(3).tolist()):
        assert bytes(x[row].tolist()) == raw[start : start + 20]
        assert bytes(y[row].tolist()) == raw[start + 1 : start + 21]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_data_parallel_shards_concatenate_to_the_global_batch(world_size):
    sampler = BatchSampler(_data(), 12, 16, seed=2)
    for step in (0, 7):
        x, y = sampler.batch(step)
        shards = [sampler.batch(step, rank=r, world_size=world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([s[0] for s in shards]), x)
        assert torch.equal(torch.cat([s[1] for s in shards]), y)
    val = validation_batches(_data(seed=1), 2, 12, 16)
    val_shards = [
        validation_batches(_data(seed=1), 2, 12, 16, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for i in range(2):
        assert torch.equal(torch.cat([v[i][0] for v in val_shards]), val[i][0])


def test_uneven_or_invalid_shards_are_rejected():
    with pytest.raises(ValueError, match="multiple of world_size"):
        shard_rows(10, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        shard_rows(12, 3, 3)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(_data(10), 2, 16)


# ----------------------------------------------------------------- model ----


CONFIGS = [
    GPTConfig.tiny(),
    GPTConfig.tiny(qkv="separate", positions="learned", norm="layernorm", bias=True),
    GPTConfig.tiny(tie_embeddings=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["fused-rope", "separate-learned-ln", "tied"])
def test_forward_backward_reaches_every_parameter(config):
    model = GPT(config)
    x = torch.randint(0, 256, (3, config.seq_len))
    logits = model(x)
    assert logits.shape == (3, config.seq_len, 256)
    model.loss(x, x.roll(-1, dims=1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("config", CONFIGS[:2], ids=["rope", "learned"])
def test_attention_is_causal(config):
    model = GPT(config)
    x = torch.randint(0, 256, (1, 20))
    x2 = x.clone()
    x2[0, 12:] = (x2[0, 12:] + 1) % 256  # change only the future of position 11
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_init_depends_on_the_seed_only_and_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = GPT(GPTConfig.tiny(seed=4))
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(77)
    b = GPT(GPTConfig.tiny(seed=4))
    c = GPT(GPTConfig.tiny(seed=5))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["blocks.0.attn.qkv.weight"], pc["blocks.0.attn.qkv.weight"])
    # GPT-2 init: N(0, 0.02²), residual projections N(0, (0.02/√(2L))²).
    std = pa["blocks.0.mlp.fc.weight"].std().item()
    proj_std = pa["blocks.0.mlp.proj.weight"].std().item()
    assert 0.015 < std < 0.025 and 0.6 * 0.01 < proj_std < 1.4 * 0.01


def test_blocks_are_a_module_list_and_the_hidden_matrices_live_in_them():
    model = GPT(GPTConfig.tiny(qkv="separate", tie_embeddings=True))
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert model.lm_head.weight is model.tok_emb.weight
    names = hidden_matrix_names(model)
    expected = {
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")
    }
    assert set(names) == expected


def test_loss_is_the_cross_entropy_of_the_logits():
    model = GPT(GPTConfig.tiny())
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    logits = model(x).double()
    # Reference: -log softmax at the target, averaged, in float64.
    ref = -(logits.log_softmax(-1).gather(-1, y[..., None])).mean()
    torch.testing.assert_close(model.loss(x, y).double(), ref, rtol=1e-5, atol=1e-6)


def test_bad_model_configs_are_named():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="qkv"):
        GPTConfig(qkv="packed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len"):
        GPT(GPTConfig.tiny())(torch.zeros(1, 64, dtype=torch.long))


# ------------------------------------------------------------ optimizers ----


def test_a_few_adamw_steps_reduce_the_loss_on_a_fixed_batch():
    model = GPT(GPTConfig.tiny())
    opt = build_optimizer("adamw", model, lr=3e-3)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, dims=1)
    losses = []
    for _ in range(10):
        loss = model.loss(x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 0.5, losses


def test_torch_muon_gets_exactly_the_hidden_matrices_and_adamw_the_rest():
    model = GPT(GPTConfig.tiny(positions="learned"))
    opt = build_optimizer("torch_muon", model, lr=2e-3, scalar_lr=3e-3, weight_decay=0.1)
    muon, adamw = opt.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert muon_names == set(hidden_matrix_names(model)) == set(opt.matrix_names)
    assert adamw_names == set(names.values()) - muon_names
    assert {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"} <= adamw_names
    assert muon.param_groups[0]["weight_decay"] == 0.1
    assert all(g["weight_decay"] == 0.0 and g["lr"] == 3e-3 for g in adamw.param_groups)
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_adamw_decays_only_the_hidden_matrices():
    model = GPT(GPTConfig.tiny())
    (opt,) = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.1).optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        decayed = {names[id(p)] for p in group["params"]}
        if group["weight_decay"] > 0:
            assert decayed == set(hidden_matrix_names(model))
        else:
            assert decayed.isdisjoint(hidden_matrix_names(model))


def test_schedule_matches_its_formula_and_drives_every_group():
    total, warmup = 50, 5
    for s in (0, 4, 5, 20, 49):
        if s < warmup:
            ref = (s + 1) / warmup
        else:
            ref = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
        assert lr_multiplier(s, total, warmup, "cosine", 0.1) == pytest.approx(ref)
    assert lr_multiplier(30, 50, 10, "linear", 0.0) == pytest.approx(0.5)
    model = GPT(GPTConfig.tiny())
    opt = build_optimizer("torch_muon", model, lr=2e-3, scalar_lr=4e-3)
    opt.attach_schedule(lambda s: lr_multiplier(s, total, warmup))
    assert opt.lrs() == pytest.approx([2e-3 / 5, 4e-3 / 5])
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_multiplier(0, 10, 10)


def test_unknown_optimizer_names_are_rejected():
    model = GPT(GPTConfig.tiny())
    for bad in ("sgd", "dmuon:", "dmuon"):
        with pytest.raises(ValueError, match="dmuon:<rule>"):
            build_optimizer(bad, model, lr=1e-3, scalar_lr=1e-3)
    with pytest.raises(ValueError, match="lr"):
        build_optimizer("adamw", model, lr=-1.0)


def test_missing_dmuon_names_fail_with_a_message_naming_them(monkeypatch):
    # A dmuon.optim without the API (the state of a branch before it lands).
    monkeypatch.setitem(sys.modules, "dmuon.optim", types.ModuleType("dmuon.optim"))
    with pytest.raises(DMuonUnavailableError, match="DMuon and no param_groups"):
        require_dmuon()
    with pytest.raises(DMuonUnavailableError, match=r"from dmuon\.optim import DMuon"):
        build_optimizer("dmuon:muon", GPT(GPTConfig.tiny()), lr=1e-3, scalar_lr=1e-3)


def _dmuon_available():
    try:
        require_dmuon()
    except DMuonUnavailableError:
        return False
    return True


@pytest.mark.skipif(not _dmuon_available(), reason="dmuon.optim.DMuon is not installed")
def test_dmuon_follows_the_shared_split_and_reduces_the_loss():
    model = GPT(GPTConfig.tiny())
    opt = build_optimizer("dmuon:muon", model, lr=3e-3, scalar_lr=3e-3)
    assert opt.notes == [], opt.notes  # param_groups agrees with hidden_matrix_names
    opt.attach_schedule(lambda s: 1.0)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    first = model.loss(x, x.roll(-1, 1)).item()
    for _ in range(10):
        model.loss(x, x.roll(-1, 1)).backward()
        opt.step()
        opt.zero_grad()
    assert model.loss(x, x.roll(-1, 1)).item() < first - 0.5


# ---------------------------------------------------------- loop, metrics ----


def test_train_loop_records_curves_and_sees_the_sampler_order():
    data = _data(20_000)
    sampler = BatchSampler(data, 4, 32, seed=0)
    val = validation_batches(data, 2, 4, 32, seed=9)
    curves = []
    for _ in range(2):
        model = GPT(GPTConfig.tiny())
        opt = build_optimizer("adamw", model, lr=3e-3)
        curves.append(train(model, opt, sampler, val, steps=6, eval_every=4))
    a, b = curves
    assert a.eval_steps == [0, 4, 6] and len(a.train_loss) == 6
    assert a.train_loss == b.train_loss and a.val_loss == b.val_loss  # same data, same init
    assert a.train_seconds == sorted(a.train_seconds) and not a.diverged


def test_steps_to_reach_interpolates_between_evaluations():
    assert steps_to_reach([0, 10, 20, 30], [4.0, 3.0, 2.0, 1.0], 2.5) == pytest.approx(15.0)
    assert steps_to_reach([0, 10], [4.0, 3.0], 3.0) == pytest.approx(10.0)
    assert steps_to_reach([0, 10], [4.0, 3.0], 2.9) is None


# -------------------------------------------------------------- train.py ----


def test_train_py_quick_runs_end_to_end_and_writes_its_results(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "train.py"),
        "--quick",
        "--optimizers",
        "adamw,torch_muon",
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    # train.py puts the repository root on sys.path itself; dmuon comes from the
    # interpreter's installs (or an inherited PYTHONPATH), as for a user.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "train-cpu-quick.json").read_text())
    assert set(result["runs"]) == {"adamw", "torch_muon"}
    for run in result["runs"].values():
        assert run["curve"]["eval_steps"] == [0, 3, 6]
        assert all(math.isfinite(v) for v in run["curve"]["val_loss"])
        assert run["lr_source"] == "table"
    assert result["runs"]["torch_muon"]["scalar_lr"] == result["runs"]["adamw"]["lr"]
    assert result["summary"]["rows"]["adamw"]["fraction_of_baseline_steps"] is not None
    assert result["config"]["corpus"]["split"] == "by_file"
    assert result["meta"]["date"] and result["meta"]["torch"] == torch.__version__
    for suffix in ("val-vs-step", "val-vs-time"):
        assert (tmp_path / f"train-cpu-quick-{suffix}.png").stat().st_size > 1000
    assert "of AdamW steps" in proc.stdout
