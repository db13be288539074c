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
    import importlib.util

    spec = importlib.util.spec_from_file_location("lightning_ddp", SCRIPT)
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
