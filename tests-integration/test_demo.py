"""The README's main job, ``benchmarks/demo.py``, end to end at a tiny size.

Two gloo ranks train the byte-level GPT with DMuon (owner mode + FSDP2) and with
AdamW (FSDP2) for a few steps on the built-in corpus; the test checks what the
demo promises: both runs trained (the validation loss fell below its start, near
ln 256 for bytes), DMuon really ran in owner mode with every matrix stepped by
exactly one rank, and the JSON and PNG were written. The loss comparison itself
is the demo's output, not asserted: a few steps at this size say nothing about it.
"""

from __future__ import annotations

import json
import math

from benchmarks import demo

STEPS = 4


def test_demo_trains_both_optimizers_and_writes_its_results(tmp_path, capsys):
    argv = ["--world", "2", "--size", "tiny", "--steps", str(STEPS), "--eval-every", "2"]
    assert demo.main([*argv, "--no-progress", "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "demo-cpu-w2-tiny.json").read_text())
    assert (tmp_path / "demo-cpu-w2-tiny.png").stat().st_size > 10_000
    assert set(result["runs"]) == {"dmuon", "adamw"}
    for name, run in result["runs"].items():
        assert len(run["train_loss"]) == STEPS and all(map(math.isfinite, run["train_loss"]))
        assert run["eval_steps"] == [0, 2, 4]
        assert run["val_loss"][-1] < run["val_loss"][0] - 0.05, f"{name} did not train"
        assert len(run["step_seconds"]) == STEPS and run["median_step_seconds"] > 0
    dmuon = result["runs"]["dmuon"]
    assert dmuon["mode"] == "owner"
    owned = [n for per_rank in dmuon["owned"] for n in per_rank]
    assert sorted(owned) == sorted(dmuon["dedicated"]), "each matrix has exactly one owner"
    # tiny matrices of one layer are packed into one owner unit; two layers, two ranks
    assert all(dmuon["owned"]), "a rank owns nothing: the plan did not spread the layers"
    assert len(dmuon["dedicated"]) == 4 * result["settings"]["size"]["n_layer"]
    out = capsys.readouterr().out
    assert "DMuon (owner + FSDP2)" in out and "AdamW (FSDP2)" in out and "ms / step" in out
