"""DMuon in ``configure_optimizers`` under Lightning's DDP strategy equals one process.

``examples/lightning_ddp.py`` is run as a user runs it (``python script --devices 2``;
Lightning's own launcher starts the second process, CPU, gloo) for 5 steps. Its
ranks' final parameters must equal those of the same LightningModule trained in this
process by a plain loop with ``DMuon`` (single mode) on the same global batches: the
rows torch's ``DistributedSampler`` gives each rank (Lightning injects one that
shuffles with seed 0 under DDP), a step's loss being the mean of the two ranks' mean
losses, which is what DDP's gradient average computes.

Tolerance 1e-5 (fp32 Newton–Schulz): the runs differ only in the order of the
gradient sums. The guide (docs/guides/lightning.md) shows the script verbatim.
"""

from __future__ import annotations

import itertools
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("lightning", reason="pip install 'dmuon-integrations[lightning]'")

import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "lightning_ddp.py"
STEPS, PER_RANK, WORLD = 5, 16, 2
TOLERANCE = 1e-5


def _example():
    return _example_at(SCRIPT)


def _example_at(script: pathlib.Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # guarded by __main__: defines, does not train
    return module


def _reference(example) -> dict[str, torch.Tensor]:
    from torch.utils.data import DistributedSampler

    model = example.Regressor()
    opt = model.configure_optimizers()  # no process group here: single mode
    assert opt.mode == "single"
    data = example.dataset()
    loaders = [
        iter(
            DataLoader(
                data,
                batch_size=PER_RANK,
                sampler=DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=True, seed=0),
            )
        )
        for r in range(WORLD)
    ]
    for _ in range(STEPS):
        losses = [nn.functional.mse_loss(model(x), y) for x, y in map(next, loaders)]
        (sum(losses) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_lightning_ddp_equals_single_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, sorted((ROOT / "packages").glob("*/src"))), env.get("PYTHONPATH", "")]
    )
    out = tmp_path / "params"
    cmd = [sys.executable, str(SCRIPT), "--devices", str(WORLD), "--steps", str(STEPS)]
    cmd += ["--batch-size", str(PER_RANK), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "DMuon mode replicated" in proc.stdout, proc.stdout[-2000:]

    example = _example()
    expected = _reference(example)
    initial = dict(example.Regressor().named_parameters())
    moved = max(float((expected[n] - initial[n].detach()).abs().max()) for n in expected)
    assert moved > 1e-2, "the reference barely trained: the comparison would prove nothing"
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in range(WORLD)]
    for rank, got in enumerate(ranks):
        assert got.keys() == expected.keys()
        for name in expected:
            diff = float((got[name] - expected[name]).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"
            assert torch.equal(got[name], ranks[0][name]), f"ranks differ at {name}"


def test_the_guide_shows_the_example_verbatim():
    guide = (ROOT / "docs" / "guides" / "lightning.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert SCRIPT.read_text() in blocks, "docs/guides/lightning.md must show the script as is"


# ----------------------------------------------------------------- owner mode (DMuonStrategy)
OWNER_SCRIPT = ROOT / "examples" / "lightning_owner.py"
# 128 samples, 16 per rank and micro-batch, 2 ranks: 4 micro-batches per epoch and rank,
# so with 2 micro-batches per step an epoch is 2 optimizer steps and a checkpoint taken at
# the end of epoch 0 resumes at an epoch boundary (no mid-epoch sampler position to restore).
OWNER_SAMPLES, OWNER_EPOCHS, ACCUMULATE = 128, 2, 2
CLIP = 0.2  # Trainer(gradient_clip_val=CLIP): below most steps' gradient norms (checked)
RESUME_TOLERANCE = 1e-6  # the same arithmetic in the same order: equal up to fp32 rounding


def _run(script: pathlib.Path, tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, sorted((ROOT / "packages").glob("*/src"))), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, str(script), "--devices", str(WORLD), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _owner_reference(
    example,
    *,
    epochs: int = OWNER_EPOCHS,
    scaler: torch.amp.GradScaler | None = None,
    clip: float = CLIP,
) -> dict[str, torch.Tensor]:
    """The module trained in this process by a plain loop: same global micro-batches,
    Lightning's loss scaling (1/accumulate), torch's clipping by the norm before each
    step, the scheduler stepped per optimizer step.

    With ``scaler``: fp16 autocast as Lightning's ``MixedPrecision("16-mixed")``, each
    rank's losses scaled and back-propagated on their own (the fp16 values, and so their
    overflows, are those of that rank's backward), each rank's micro-batches summed,
    then the ranks' sums (the order of the owners' reductions), the gradients
    unscaled, divided by the ranks (the owners' average) and clipped, then
    ``scaler.step`` (a step with an Inf gradient skipped) and ``scaler.update``; the
    clipping must then bind on some steps and not on others, or a gradient left
    scaled would go unseen (Muon's update does not change with the gradient's scale).
    """
    from torch.utils.data import DistributedSampler

    model = example.Regressor()
    config = model.configure_optimizers()  # no Trainer: dmuon_optimizer picks single mode
    opt, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert opt.mode == "single"
    data = example.dataset(OWNER_SAMPLES)
    samplers = [DistributedSampler(data, num_replicas=WORLD, rank=r, seed=0) for r in range(WORLD)]
    autocast = torch.autocast("cpu", dtype=torch.half, cache_enabled=False)
    norms = []
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)  # Lightning reshuffles every epoch
        loaders = [iter(DataLoader(data, batch_size=PER_RANK, sampler=s)) for s in samplers]
        for _ in range(len(samplers[0]) // (PER_RANK * ACCUMULATE)):
            if scaler is None:
                for _ in range(ACCUMULATE):
                    losses = [nn.functional.mse_loss(model(x), y) for x, y in map(next, loaders)]
                    (sum(losses) / WORLD / ACCUMULATE).backward()
            else:  # each rank's micro-batches summed on their own, then over the ranks
                summed: list[torch.Tensor] = []
                for loader in loaders:
                    opt.zero_grad()
                    for _ in range(ACCUMULATE):
                        x, y = next(loader)
                        with autocast:
                            loss = nn.functional.mse_loss(model(x), y)
                        scaler.scale(loss / ACCUMULATE).backward()
                    grads = [p.grad.clone() for p in model.parameters()]
                    summed = (
                        [a + b for a, b in zip(summed, grads, strict=True)] if summed else grads
                    )
                for p, g in zip(model.parameters(), summed, strict=True):
                    p.grad = g
                scaler.unscale_(opt)
                for p in model.parameters():
                    p.grad.div_(WORLD)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            schedule.step()
    clipped = sum(n > clip for n in norms if math.isfinite(n))
    finite = sum(map(math.isfinite, norms))
    assert clipped >= finite // 2, f"clipping active at {clipped} of the steps {norms}"
    if scaler is not None:
        assert clipped < finite, f"clipping active at every step {norms}"
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_lightning_owner_mode_equals_single_process_and_resumes(tmp_path):
    """DMuonStrategy at 2 ranks, 2 micro-batches per step, a LambdaLR scheduler, and
    ``Trainer(gradient_clip_val=CLIP)``:

    * the optimizer runs in owner mode and the first micro-batch of a step reduces nothing;
    * both ranks end with the single-process parameters (1e-5), that process clipping
      with torch's ``clip_grad_norm_`` (Lightning's clipping goes to DMuon's through the
      strategy's precision plugin; torch's would raise ``GradientChangedError``);
    * the checkpoint of epoch 0 holds every matrix's momentum (each from its owner), and a
      new run resumed from it ends where the uninterrupted run ended (1e-6).

    Replicated mode's checkpoints are checked without Lightning's launcher (below): one
    more Lightning run would add half again to this test's time.
    """
    from dmuon.integrations.lightning import CHECKPOINT_FORMAT

    common = ["--samples", str(OWNER_SAMPLES), "--epochs", str(OWNER_EPOCHS)]
    common += ["--accumulate", str(ACCUMULATE), "--batch-size", str(PER_RANK)]
    common += ["--clip-val", str(CLIP)]
    full = _run(OWNER_SCRIPT, tmp_path, *common, "--ckpt-dir", "ckpt", "--out", "full")
    assert full.stdout.count("DMuon mode owner") == WORLD, full.stdout[-2000:]
    ckpt = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    resumed = _run(OWNER_SCRIPT, tmp_path, *common, "--resume", str(ckpt), "--out", "resumed")
    assert resumed.stdout.count("DMuon mode owner") == WORLD, resumed.stdout[-2000:]

    example = _example_at(OWNER_SCRIPT)
    expected = _owner_reference(example)
    initial = dict(example.Regressor().named_parameters())
    moved = max(float((expected[n] - initial[n].detach()).abs().max()) for n in expected)
    assert moved > 1e-2, "the reference barely trained: the comparison would prove nothing"

    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert saved["format"] == CHECKPOINT_FORMAT
    for name in ("net.0.weight", "net.2.weight", "net.4.weight"):
        momentum = saved["optim"]["state"][name]["momentum_buffer"]
        assert float(momentum.norm()) > 0, f"{name}: its owner's momentum is not in the checkpoint"

    for rank in range(WORLD):
        got = torch.load(tmp_path / f"full.rank{rank}.pt")
        again = torch.load(tmp_path / f"resumed.rank{rank}.pt")
        assert got["mode"] == "owner"
        assert got["owned"], f"rank {rank} owns no matrix: the resume would prove less"
        # Owner reductions issued so far, after each backward: none on a step's first
        # micro-batch (no_sync), some on its last.
        calls = [0, *got["reductions"]]
        added = [b - a for a, b in itertools.pairwise(calls)]
        assert added[0::2] == [0] * (len(added) // 2) and min(added[1::2]) > 0, added
        for name in expected:
            diff = float((got["params"][name] - expected[name]).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"
            diff = float((again["params"][name] - got["params"][name]).abs().max())
            assert diff <= RESUME_TOLERANCE, f"rank {rank}: resumed {name} differs by {diff:.2e}"


FP16_EPOCHS, FP16_INIT_SCALE = 3, 2.0**20  # the first 2 of the 6 steps overflow (checked)
FP16_CLIP = 0.23  # binds on 2 of the 4 steps taken (norms 0.245, 0.244, 0.218, 0.219)
# Measured 1.5e-5. The gradients' summation order differs (as in fp32, where it leaves
# 2e-7), but Newton–Schulz amplifies it more here: fp16-rounded gradients give the
# momentum a tail of small singular values, where the iteration's gain is largest.
FP16_TOLERANCE = 1e-4


def test_lightning_owner_mode_fp16_loss_scaling_equals_single_process(tmp_path):
    """DMuonStrategy with Lightning's fp16 ``MixedPrecision`` (a ``GradScaler`` on CPU,
    started at a loss scale that overflows): the strategy makes it a
    ``ShardedGradScaler``, the step unscales after the reductions to the owners, and
    every rank skips exactly the steps a single process with torch's ``GradScaler``
    skips, ending with its loss scale and (1e-4) its parameters, clipping included.

    Before, owner mode refused fp16: Lightning's ``GradScaler`` looked for an Inf in
    one rank's gradients only."""
    common = ["--samples", str(OWNER_SAMPLES), "--epochs", str(FP16_EPOCHS)]
    common += ["--accumulate", str(ACCUMULATE), "--batch-size", str(PER_RANK)]
    common += ["--clip-val", str(FP16_CLIP), "--precision", "16-mixed"]
    common += ["--init-scale", str(FP16_INIT_SCALE)]
    run = _run(OWNER_SCRIPT, tmp_path, *common, "--out", "fp16")
    assert run.stdout.count("DMuon mode owner") == WORLD, run.stdout[-2000:]

    example = _example_at(OWNER_SCRIPT)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE)
    expected = _owner_reference(example, epochs=FP16_EPOCHS, scaler=scaler, clip=FP16_CLIP)
    steps = FP16_EPOCHS * OWNER_SAMPLES // (WORLD * PER_RANK * ACCUMULATE)
    # Each skip halves the scale, each taken step leaves it (growth_interval 2000).
    skips = round(math.log2(FP16_INIT_SCALE / scaler.get_scale()))
    assert 0 < skips < steps, f"{skips} of {steps} steps skipped: nothing shows agreement"
    initial = dict(example.Regressor().named_parameters())
    moved = max(float((expected[n] - initial[n].detach()).abs().max()) for n in expected)
    assert moved > 1e-2, "the reference barely trained: the comparison would prove nothing"
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"fp16.rank{rank}.pt")
        assert got["mode"] == "owner" and got["owned"], (rank, got["owned"])
        assert got["skipped_steps"] == skips, (rank, got["skipped_steps"], skips)
        assert got["loss_scale"] == scaler.get_scale(), (rank, got["loss_scale"])
        for name in expected:
            diff = float((got["params"][name] - expected[name]).abs().max())
            assert diff <= FP16_TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def test_dmuon_strategy_refuses_what_it_cannot_serve():
    import lightning as L

    from dmuon.integrations.lightning import DMuonStrategy, dmuon_optimizer

    with pytest.raises(ValueError, match="mode must be one of"):
        DMuonStrategy("sharded")
    with pytest.raises(ValueError, match=r"no DDP wrapper.*find_unused_parameters"):
        DMuonStrategy(find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"no DDP wrapper.*ddp_comm_hook"):
        DMuonStrategy(ddp_comm_hook=print)
    with pytest.raises(ValueError, match="configure owner mode"):
        DMuonStrategy("replicated", scalars="owner")
    assert DMuonStrategy("replicated", find_unused_parameters=True).mode == "replicated"

    example = _example_at(OWNER_SCRIPT)
    with pytest.raises(ValueError, match="chooses"):
        dmuon_optimizer(example.Regressor(), mode="owner")
    trainer = L.Trainer(strategy="dmuon", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is DMuonStrategy and trainer.strategy.mode == "owner"


def test_the_strategys_precision_plugin_clips_a_dmuon_with_dmuons_functions():
    """The plugin Lightning picks (``precision=`` or ``plugins=``) stays what it was, and
    clips a DMuon by DMuon's functions; another optimizer by the plugin's own."""
    import functools
    import pickle

    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from dmuon.integrations.lightning import (
        DMuonPrecision,
        DMuonStrategy,
        agree_loss_scaler,
        with_dmuon_precision,
    )
    from dmuon.optim import DMuon, clip_grad_norm_, clip_grad_value_, param_groups

    trainer = L.Trainer(
        strategy=DMuonStrategy(), accelerator="cpu", devices=1, precision="bf16-mixed"
    )
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and isinstance(plugin, DMuonPrecision)
    assert plugin.precision == "bf16-mixed"
    mine = Precision()
    trainer = L.Trainer(strategy=DMuonStrategy(), accelerator="cpu", devices=1, plugins=[mine])
    assert trainer.precision_plugin is mine and isinstance(mine, DMuonPrecision)
    assert with_dmuon_precision(mine) is mine
    again = pickle.loads(pickle.dumps(mine))  # a spawned process gets the plugin pickled
    assert isinstance(again, DMuonPrecision) and type(again) is type(mine)
    fp16 = with_dmuon_precision(MixedPrecision("16-mixed", "cpu"))  # state with __getstate__
    again = pickle.loads(pickle.dumps(fp16))
    assert type(again) is type(fp16) and isinstance(again.scaler, torch.amp.GradScaler)
    # fp16: owner mode's plugin gets a ShardedGradScaler with the GradScaler's settings,
    # replicated mode (DDP all-reduces every gradient) keeps Lightning's
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    for mode, kind in (("owner", ShardedGradScaler), ("replicated", torch.amp.GradScaler)):
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=7)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        trainer = L.Trainer(
            strategy=DMuonStrategy(mode), accelerator="cpu", devices=1, plugins=[plugin]
        )
        got = trainer.precision_plugin.scaler
        assert type(got) is kind, (mode, type(got))
        assert (got.get_scale(), got.get_growth_interval()) == (8.0, 7), mode
        assert type(pickle.loads(pickle.dumps(trainer.precision_plugin)).scaler) is kind
        # Lightning keys the plugin's checkpoint state by its class's __qualname__: the
        # same as under strategy="ddp", so a checkpoint keeps its loss scale across them
        assert type(trainer.precision_plugin).__qualname__ == "MixedPrecision"
    # the plugin given to the strategy itself (set inside DDPStrategy's __init__)
    given = DMuonStrategy(precision_plugin=MixedPrecision("16-mixed", "cpu"))
    assert type(given.precision_plugin.scaler) is ShardedGradScaler
    off = torch.amp.GradScaler("cpu", enabled=False)  # a disabled scaler stays as it is
    assert agree_loss_scaler(MixedPrecision("16-mixed", "cpu", scaler=off)).scaler is off
    with pytest.raises(TypeError, match="Lightning Precision plugin"):
        with_dmuon_precision(object())

    def grads(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        return model

    for clip, ours, theirs in (
        (mine.clip_grad_by_norm, clip_grad_norm_, torch.nn.utils.clip_grad_norm_),
        (mine.clip_grad_by_value, clip_grad_value_, torch.nn.utils.clip_grad_value_),
    ):
        expected, got, other = grads(0), grads(0), grads(0)
        theirs(expected.parameters(), 0.5)
        calls: list[str] = []
        dmuon = DMuon(param_groups(got), lr=0.02)
        dmuon.engine.prepare_grads = functools.partial(calls.append, "prepare_grads")
        clip(dmuon, 0.5)  # both of DMuon's functions finish the reductions first
        assert calls == ["prepare_grads"], f"{clip.__name__} did not call {ours.__name__}"
        clip(torch.optim.SGD(other.parameters(), lr=0.1), 0.5)
        pairs = zip(expected.parameters(), got.parameters(), other.parameters(), strict=True)
        for a, b, c in pairs:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(c.grad, a.grad, rtol=0, atol=0)


def _mixed_precision_clipping(rank: int, world: int) -> dict[str, str]:
    """Owner mode, Lightning's bf16 ``MixedPrecision`` plugin clipping by norm and by
    value: the same gradients as DMuon's functions called directly; fp16: with a plain
    GradScaler refused by name, with a ShardedGradScaler unscaled, then clipped."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from dmuon.integrations import ddp
    from dmuon.integrations.lightning import agree_loss_scaler, with_dmuon_precision
    from dmuon.optim import DMuon, clip_grad_norm_, clip_grad_value_, param_groups

    def owner_model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
        return m, DMuon(param_groups(m), distributed=ddp.dedicate(m), lr=0.02)

    def backward(m):
        g = torch.Generator().manual_seed(rank)
        nn.functional.mse_loss(m(torch.randn(4, 6, generator=g)), torch.zeros(4, 3)).backward()

    out = {}
    bf16 = with_dmuon_precision(MixedPrecision("bf16-mixed", "cpu"))
    cases = (("norm", GradClipAlgorithmType.NORM, clip_grad_norm_, 0.05),
             ("value", GradClipAlgorithmType.VALUE, clip_grad_value_, 0.01))  # fmt: skip
    for name, algorithm, direct, value in cases:
        (m, opt), (ref, ref_opt) = owner_model(), owner_model()
        backward(m)
        backward(ref)
        bf16.clip_gradients(opt, value, algorithm)
        direct(ref_opt, value)
        same = all(
            (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
            for a, b in zip(m.parameters(), ref.parameters(), strict=True)
        )
        held = sum(p.grad is not None for p in m.parameters())
        out[name] = f"same={same} held={held}"
        opt.step()
        ref_opt.step()

    def scaled_backward(m, scaler):
        g = torch.Generator().manual_seed(rank)
        loss = nn.functional.mse_loss(m(torch.randn(4, 6, generator=g)), torch.zeros(4, 3))
        scaler.scale(loss).backward()

    # Lightning's fp16 plugin as it comes (a GradScaler): refused by name, nothing unscaled.
    plain = with_dmuon_precision(MixedPrecision("16-mixed", "cpu"))
    m, opt = owner_model()
    scaled_backward(m, plain.scaler)
    try:
        plain.clip_gradients(opt, 0.05, GradClipAlgorithmType.NORM)
        out["plain"] = "clipped"
    except TypeError as err:
        out["plain"] = f"{err} unscaled={opt.unscaled}"
    opt.step()  # finishes the reductions
    # As DMuonStrategy gives it (a ShardedGradScaler): clipping unscales first, once;
    # the same gradients as opt.unscale_ + clip_grad_norm_ called directly.
    agreed = agree_loss_scaler(with_dmuon_precision(MixedPrecision("16-mixed", "cpu")))
    ref_scaler = ShardedGradScaler(device="cpu")
    (m, opt), (ref, ref_opt) = owner_model(), owner_model()
    scaled_backward(m, agreed.scaler)
    scaled_backward(ref, ref_scaler)
    agreed.clip_gradients(opt, 0.05, GradClipAlgorithmType.NORM)
    ref_opt.unscale_(ref_scaler)
    clip_grad_norm_(ref_opt, 0.05)
    same = all(
        (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
        for a, b in zip(m.parameters(), ref.parameters(), strict=True)
    )
    out["fp16"] = f"same={same} unscaled={opt.unscaled}"
    for scaler, o in ((agreed.scaler, opt), (ref_scaler, ref_opt)):
        scaler.step(o)
        scaler.update()
    out["after"] = f"unscaled={opt.unscaled} steps={opt.steps_taken}"
    # a disabled scaler: nothing to unscale, clipped as under bf16
    off = with_dmuon_precision(
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    )
    (m, opt), (ref, ref_opt) = owner_model(), owner_model()
    backward(m)
    backward(ref)
    off.clip_gradients(opt, 0.05, GradClipAlgorithmType.NORM)
    clip_grad_norm_(ref_opt, 0.05)
    same = all(
        (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
        for a, b in zip(m.parameters(), ref.parameters(), strict=True)
    )
    out["disabled"] = f"same={same}"
    opt.step()
    ref_opt.step()
    return out


def test_owner_mode_clips_under_mixed_precision():
    """Lightning's ``MixedPrecision.clip_gradients`` refuses any optimizer that unscales
    itself (``_step_supports_amp_scaling``, set by owner mode): under ``bf16-mixed`` the
    strategy's plugin clipped nothing and raised on every rank. Under ``16-mixed`` the
    plugin unscales through ``DMuon.unscale_`` first (Lightning's manual optimization
    clips before ``opt.step()``) with the ``ShardedGradScaler`` the strategy gives it;
    a plain ``GradScaler`` is refused by name before anything is unscaled."""
    from dmuon.comm.testing import run_on_ranks

    for rank, out in enumerate(run_on_ranks(_mixed_precision_clipping, WORLD, timeout=120)):
        for name in ("norm", "value"):
            assert out[name].startswith("same=True") and "held=0" not in out[name], (rank, out)
        assert "needs a ShardedGradScaler" in out["plain"], (rank, out["plain"])
        assert out["plain"].endswith("unscaled=False"), (rank, out["plain"])
        assert out["fp16"] == "same=True unscaled=True", (rank, out["fp16"])
        assert out["after"] == "unscaled=False steps=1", (rank, out["after"])
        assert out["disabled"] == "same=True", (rank, out["disabled"])


def _load_checks(rank: int, world: int, tmp: str) -> tuple[int, list[str]]:
    from dmuon.integrations.hf import missing_state
    from dmuon.integrations.lightning import DMuonStrategy
    from dmuon.optim import DMuon, param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2))
    opt = DMuon(param_groups(model), lr=0.02, mode="replicated")
    model(torch.randn(4, 8)).square().sum().backward()  # the same gradients everywhere, as DDP
    opt.step()
    strategy = DMuonStrategy("replicated")
    strategy.optimizers = [opt]
    whole = strategy.optimizer_state(opt)  # a collective: every rank calls it
    if rank == 0:  # what strategy="ddp" writes: rank 0's own state dict
        torch.save(opt.state_dict(), f"{tmp}/rank0.pt")
    torch.distributed.barrier()
    rank0 = torch.load(f"{tmp}/rank0.pt")
    before = {k: v.clone() for st in opt.state_dict()["state"].values() for k, v in st.items()}
    with pytest.raises(ValueError, match="restart that momentum from zero"):
        strategy.load_optimizer_state_dict({"optimizer_states": [rank0]})
    with pytest.raises(ValueError, match="holds 2 optimizer state"):
        strategy.load_optimizer_state_dict({"optimizer_states": [whole, whole]})
    after = {k: v for st in opt.state_dict()["state"].values() for k, v in st.items()}
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed state"
    strategy.load_optimizer_state_dict({"optimizer_states": [whole]})
    return len(missing_state(rank0)), missing_state(whole)


def test_replicated_checkpoints_are_whole_and_incomplete_ones_refused(tmp_path):
    """Rank 0's own replicated-mode state dict (what ``strategy="ddp"`` saves) lacks the
    momentum of the matrices rank 1 owns; DMuonStrategy refuses to load it on every rank
    (no hang, nothing changed) and saves and loads the gathered one."""
    from dmuon.comm.testing import run_on_ranks

    results = run_on_ranks(_load_checks, WORLD, args=(str(tmp_path),), timeout=120)
    for lost, missing in results:
        assert lost > 0, "rank 0 owned every matrix: the check would prove nothing"
        assert missing == []


def _owner_checkpoint_checks(rank: int, world: int, tmp: str) -> list[str]:
    from dmuon.integrations.lightning import DMuonStrategy
    from dmuon.optim import DMuon, param_groups

    example = _example_at(OWNER_SCRIPT)
    module = example.Regressor()
    strategy = DMuonStrategy(dedicate_options={"reshard_after_forward": True})
    strategy.connect(module)
    strategy.configure_ddp()  # what Trainer.fit's setup calls: dedicates the module
    ded = strategy.dedication
    opt = DMuon(param_groups(module), lr=0.02, distributed=ded, ns_compute_dtype="float32")
    strategy.optimizers = [opt]
    x, y = example.dataset(32)[rank * 16 : rank * 16 + 16]
    nn.functional.mse_loss(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    # What Lightning's dump_checkpoint calls, in its order, on every rank.
    weights = strategy.lightning_module_state_dict()
    live = {k: v.detach().clone() for k, v in weights.items()}
    state = strategy.optimizer_state(opt)  # gathers, then frees the weights not owned
    # Lightning writes `weights` now, with the weights this rank does not own freed.
    assert all(torch.equal(weights[k], live[k]) for k in live), "the saved weights changed"
    if rank == 0:
        torch.save({"state_dict": weights, "optimizer_states": [state]}, f"{tmp}/ckpt.pt")
    torch.distributed.barrier()
    before = {
        n: opt.state[p]["momentum_buffer"].clone()
        for n, p in module.named_parameters()
        if n in ded.owned
    }
    for p in opt.state.values():  # forget the state: the load must bring it back
        for v in p.values():
            v.zero_()
    strategy.load_optimizer_state_dict(torch.load(f"{tmp}/ckpt.pt", weights_only=False))
    for n, p in module.named_parameters():
        if n in ded.owned:
            assert torch.equal(opt.state[p]["momentum_buffer"], before[n]), n
    ded.remove()
    return list(ded.owned)


def test_owner_checkpoints_round_trip_through_the_strategy_under_zero3_like(tmp_path):
    """DMuonStrategy's checkpoint methods, called as Lightning calls them, with the
    weights a rank does not own freed between steps (``reshard_after_forward``): the
    saved weights are copies taken while whole, and each owner gets its momentum back."""
    from dmuon.comm.testing import run_on_ranks

    owned = run_on_ranks(_owner_checkpoint_checks, WORLD, args=(str(tmp_path),), timeout=120)
    assert all(owned), f"a rank owns no matrix: {owned}"


# ------------------------------------------------------ more cases (lightning_cases.py)
CASES_SCRIPT = pathlib.Path(__file__).resolve().parent / "lightning_cases.py"


# Every case in one Lightning launch (each launch costs ~20 s of CI's two cores): the ones
# that train first, then the refused ones, the one that stops mid-step last.
CASES_RUN = ("two_optimizers", "root_weights", "adamw_only", "some_ranks_only")


@pytest.fixture(scope="module")
def cases_run(tmp_path_factory) -> tuple[dict[str, list[dict]], str]:
    """Each case's per-rank result (``{"params": ...}`` or ``{"error": ...}``) and the
    launch's output."""
    tmp_path = tmp_path_factory.mktemp("lightning-cases")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, sorted((ROOT / "packages").glob("*/src"))), env.get("PYTHONPATH", "")]
    )
    out = tmp_path / "case"
    cmd = [sys.executable, str(CASES_SCRIPT), "--case", *CASES_RUN, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    results = {
        case: [torch.load(f"{out}.{case}.rank{r}.pt", weights_only=False) for r in range(WORLD)]
        for case in CASES_RUN
    }
    return results, output


def _trained(cases_run, case: str) -> list[dict[str, torch.Tensor]]:
    results = cases_run[0]
    for rank, result in enumerate(results[case]):
        assert "params" in result, f"rank {rank}: {case} raised {result.get('error')}"
    return [result["params"] for result in results[case]]


def _refused(cases_run, case: str) -> list[str]:
    results = cases_run[0]
    for rank, result in enumerate(results[case]):
        assert "error" in result, f"rank {rank}: {case} was not refused"
    return [result["error"] for result in results[case]]


def test_a_second_optimizer_stepped_before_dmuon_reads_the_averaged_gradients(cases_run):
    """Manual optimization, ``[AdamW(biases), DMuon(matrices)]`` under DMuonStrategy, each
    clipped with ``self.clip_gradients`` and stepped in that order: both ranks end with
    the parameters of one process (plain loop, torch's clipping) to 1e-5.

    In owner mode the hooks all-reduce the biases' gradients while backward runs and
    DMuon's step waits for them; the strategy now waits before another optimizer clips
    or steps. Before, the AdamW clipped and stepped this rank's own gradients (then
    DMuon raised ``GradientChangedError``; without clipping the ranks' biases drifted
    apart, 1e-2 from one process, silently).
    """
    import lightning_cases as cases

    ranks = _trained(cases_run, "two_optimizers")

    model = cases.TwoOptimizers()
    matrices, biases = cases.split(model)
    opts = [
        torch.optim.AdamW(biases, lr=cases.ADAMW_LR),
        cases.DMuon([{"params": matrices}], **cases.DMUON),  # single mode
    ]
    data = cases.dataset()
    norms = []
    for rows in cases.RankBatches(len(data), rank=None):
        x, y = data[rows]
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            params = [p for g in opt.param_groups for p in g["params"]]
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, cases.CLIP)))
            opt.step()
        for opt in opts:
            opt.zero_grad()
    assert min(norms) > cases.CLIP, f"clipping inactive at some step: {norms}"
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank, got in enumerate(ranks):
        for name, want in expected.items():
            diff = float((got[name] - want).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def test_weights_the_lightning_module_holds_itself_are_waited_for(cases_run):
    """``DMuonStrategy`` waits for the layers whose wait is the LightningModule's own
    forward pre-hook before each ``training_step`` (the trainer never calls the module):
    both ranks end with the parameters of one process. Before, the rank that did not own
    ``w`` read last step's, and every step after the first was refused."""
    import lightning_cases as cases

    ranks = _trained(cases_run, "root_weights")
    model = cases.RootWeights()
    opt = cases.DMuon(cases.param_groups(model), **cases.DMUON)  # single mode
    data = cases.dataset()
    for rows in cases.RankBatches(len(data), rank=None):
        model.training_step(data[rows], 0).backward()
        opt.step()
        opt.zero_grad()
    for rank, got in enumerate(ranks):
        for name, want in model.named_parameters():
            diff = float((got[name] - want.detach()).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def test_an_owner_mode_checkpoint_resumed_without_dmuon_strategy_says_what_to_do():
    """``trainer.fit(ckpt_path=...)`` of a DMuonStrategy (owner mode) checkpoint in one
    process under Lightning's default strategy: Lightning hands the checkpoint's entry
    (:data:`CHECKPOINT_FORMAT`) to ``DMuon.load_state_dict``, which now names the way
    (resume under DMuonStrategy, one device included). Before: "state dict is missing
    key(s) ['state', 'param_groups']", which named neither the format nor the fix.
    Under ``DMuonStrategy()`` with ``devices=1`` the same checkpoint resumes (checked by
    hand: equal to the uninterrupted 2-rank run to 5e-7)."""
    from dmuon.integrations.lightning import CHECKPOINT_FORMAT
    from dmuon.optim import DMuon, param_groups

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = DMuon(param_groups(model), lr=0.02)
    entry = {"format": CHECKPOINT_FORMAT, "optim": {"state": {}}, "dmuon": {}}
    with pytest.raises(ValueError, match="resume under DMuonStrategy") as err:
        opt.load_state_dict(entry)
    assert "owner mode" in str(err.value)


def test_owner_mode_without_a_dmuon_is_refused_on_every_rank(cases_run):
    """``configure_optimizers`` returning a plain AdamW under DMuonStrategy (owner mode):
    no step would broadcast the owners' matrices. Every rank raises when the optimizers
    are set up, naming ``dmuon_optimizer``. Before: the second backward stopped with "a
    second gradient of 'net.4.bias' arrived after its layer 'net.4' was reduced; call
    backward once per optimizer step ...", which named neither cause nor fix."""
    for error in _refused(cases_run, "adamw_only"):
        assert error.startswith("builtins.ValueError: DMuonStrategy (owner mode)"), error
        assert "configure_optimizers returned ['AdamW']" in error
        assert "dmuon_optimizer(self" in error


def test_a_layer_run_on_some_ranks_only_under_zero3_like_is_named_on_every_rank(cases_run):
    """``DMuonStrategy(dedicate_options={"reshard_after_forward": True})`` and a
    ``training_step`` that runs ``extra`` on rank 0 only at its second batch, calling the
    submodules itself (never the LightningModule's forward, where ``ddp.dedicate``'s check
    sits): the strategy begins the check with each ``training_step`` and ends it before
    ``backward``. Every rank raises ``PartialUseError`` naming ``extra.weight``, and
    teardown does not wait for broadcasts that cannot complete. Before: no check ran; the
    backward re-gathers paired wrongly and every rank stopped at DMuon's deadline with a
    ``CollectiveError``, in the step and again in teardown."""
    for error in _refused(cases_run, "some_ranks_only"):
        assert error.startswith("dmuon.integrations.partial_use.PartialUseError"), error
        assert "dedicated weight(s) ['extra.weight']" in error and "cannot go on" in error
    _, output = cases_run
    assert "CollectiveError" not in output, output[-4000:]
