"""The learning-rate grid machinery of ``benchmarks/lr_grid.py`` on a tiny configuration.

A one-layer GPT, a few steps on a small text file: what is tested is the grid's
logic (log spacing, extension at an edge, seeds at the best point, resuming from the
JSON, refusing another configuration's file), not any learning rate's merit.
"""

import itertools
import json
import math

import pytest

from benchmarks.lr_grid import best_lr, fitted_lr, grid, main, next_extension, parse_name

TINY = [
    "--quick",
    "--layers",
    "1",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--batch-size",
    "4",
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--val-batches",
    "1",
    "--points",
    "3",
    "--max-extensions",
    "1",
    "--threads",
    "1",
]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return path


def test_grid_is_log_spaced_around_its_centre():
    lrs = grid(1e-2, 5, 10**0.5)
    assert lrs[2] == pytest.approx(1e-2)
    for a, b in itertools.pairwise(lrs):
        assert b / a == pytest.approx(10**0.5)
    with pytest.raises(ValueError, match="points >= 2"):
        grid(1e-2, 1, 2.0)


def test_extension_goes_past_the_edge_holding_the_best():
    assert next_extension({1.0: 2.0, 2.0: 3.0}, 2.0) == 0.5
    assert next_extension({1.0: 3.0, 2.0: 2.0}, 2.0) == 4.0
    assert next_extension({1.0: 3.0, 2.0: 2.0, 4.0: 2.5}, 2.0) is None
    assert best_lr({1.0: math.inf, 2.0: 2.5}) == 2.0  # a diverged run never wins


def test_fitted_lr_is_the_vertex_of_a_parabola_in_log_lr():
    # loss = (log lr − log 2e-2)² + 2 sampled on a √10 grid: the vertex is exactly 2e-2.
    pts = {lr: (math.log(lr / 2e-2)) ** 2 + 2 for lr in grid(1e-2, 5, 10**0.5)}
    assert fitted_lr(pts) == pytest.approx(2e-2, rel=1e-9)
    assert fitted_lr({1e-3: 2.0, 1e-2: 3.0, 1e-1: 4.0}) is None  # best at an edge


def test_rule_options_after_plus():
    assert parse_name("dmuon:musec+clip_mode=soft") == ("dmuon:musec", {"clip_mode": "soft"})
    with pytest.raises(ValueError, match="only dmuon"):
        parse_name("adamw+eps=1")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_name("dmuon:muon+nesterov")


def test_grid_runs_extends_reruns_seeds_and_resumes(tmp_path, text, capsys):
    args = [*TINY, "--data", str(text), "--out", str(tmp_path), "--tag", "t", "--no-plots"]
    opts = ["--optimizers", "adamw,dmuon:musec+clip_mode=soft"]
    assert main([*args, *opts]) == 0
    path = tmp_path / "train-grid-cpu-quick-t.json"
    result = json.loads(path.read_text())
    rows = result["summary"]["rows"]
    assert set(rows) == {"adamw", "dmuon:musec+clip_mode=soft"}
    for spec, row in rows.items():
        lrs = [p["lr"] for p in row["grid"]]
        assert 3 <= len(lrs) <= 4  # 3 points, one more when the best sat at an edge
        assert row["best_lr"] in lrs
        assert len(row["final_val_loss_by_seed"]) == 2  # seeds 0 and 1 at the best lr
        runs = [r for r in result["runs"].values() if r["optimizer"] == spec]
        assert {r["seed"] for r in runs if r["lr"] == row["best_lr"]} == {0, 1}
    assert rows["adamw"]["lr_ratio_to_adamw"] == 1.0
    soft = [r for r in result["runs"].values() if r["optimizer"] != "adamw"]
    assert all(r["rule_options"] == {"clip_mode": "soft"} for r in soft)
    assert all(r["scalar_lr"] == 3e-3 for r in soft)  # fixed, not AdamW's best
    before = len(result["runs"])
    capsys.readouterr()
    # Resume with one more optimizer: the old runs are reused, only the new one's run.
    assert main([*args, "--optimizers", "adamw,dmuon:musec+clip_mode=soft,dmuon:muon"]) == 0
    again = json.loads(path.read_text())
    new = [r for r in again["runs"].values() if r["optimizer"] == "dmuon:muon"]
    assert len(again["runs"]) == before + len(new)
    assert "adamw lr=" not in capsys.readouterr().out  # nothing of AdamW's ran again
    # Another configuration under the same name is refused, not mixed in.
    with pytest.raises(SystemExit, match="another configuration"):
        main([*args, *opts, "--steps", "5"])


def test_plots_one_line_per_optimizer(tmp_path, text):
    args = [*TINY, "--data", str(text), "--out", str(tmp_path), "--seeds", "0"]
    assert main([*args, "--optimizers", "adamw,dmuon:muon"]) == 0
    for suffix in ("val-vs-step", "val-vs-time", "lr"):
        assert (tmp_path / f"train-grid-cpu-quick-{suffix}.png").stat().st_size > 1000
