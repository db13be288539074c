"""The learning-rate grid machinery of ``benchmarks/lr_grid.py`` on a tiny configuration.

A one-layer GPT, a few steps on a small text file: what is tested is the grid's
logic (log spacing, extension at an edge, seeds at the best point, resuming from the
JSON, refusing another configuration's file), not any learning rate's merit.
"""

import itertools
import json
import math

import pytest

from benchmarks.lr_grid import (
    best_lr,
    fitted_lr,
    grid,
    grid_gap,
    main,
    next_extension,
    parse_name,
)

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


def test_grid_gap_names_what_an_unfinished_grid_lacks():
    pts = {lr: (math.log(lr / 1e-2)) ** 2 for lr in grid(1e-2, 5, 10**0.5)}
    assert grid_gap(pts, 5, 2, 2, 2) is None
    assert grid_gap(dict(list(pts.items())[:3]), 5, 2, 1, 2) == "3 of 5 points"
    assert grid_gap(pts, 5, 2, 1, 2) == "seeds 1 of 2 at the best lr"
    edge = {lr: -math.log(lr) for lr in pts}  # best at the largest lr
    assert grid_gap(edge, 5, 2, 2, 2) == "best at the edge, 0 of 2 extensions run"
    more = {**edge, 1.0: 0.5, 3.0: 0.1}  # two extensions spent: complete, at an edge
    assert grid_gap(more, 5, 2, 2, 2) is None


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
    # Without --resume an existing grid is neither overwritten nor silently extended.
    with pytest.raises(SystemExit, match="--resume"):
        main([*args, *opts])
    # Resume with one more optimizer: the old runs are reused, only the new one's run.
    more = ["--optimizers", "adamw,dmuon:musec+clip_mode=soft,dmuon:muon", "--resume"]
    assert main([*args, *more]) == 0
    again = json.loads(path.read_text())
    new = [r for r in again["runs"].values() if r["optimizer"] == "dmuon:muon"]
    assert new
    assert len(again["runs"]) == before + len(new)
    out = capsys.readouterr().out
    assert "adamw lr=" not in out and "soft lr=" not in out  # nothing old ran again
    for key, run in result["runs"].items():  # the old runs are kept as they were
        assert again["runs"][key]["curve"] == run["curve"]
    assert [i["argv"] for i in again["invocations"]] == [[*args, *opts], [*args, *more]]
    assert {r["invocation"] for r in new} == {1}
    # Another configuration under the same name is refused, naming what differs.
    with pytest.raises(SystemExit, match="steps: 4 in the file, 5 requested"):
        main([*args, *opts, "--resume", "--steps", "5"])
    with pytest.raises(SystemExit, match=r"model\.d_model: 32 in the file, 48 requested"):
        main([*args, *opts, "--resume", "--d-model", "48"])
    assert json.loads(path.read_text()) == again  # a refusal writes nothing


def test_rerun_supersedes_one_optimizers_runs(tmp_path, text, capsys):
    args = [*TINY, "--data", str(text), "--out", str(tmp_path), "--no-plots", "--seeds", "0"]
    assert main([*args, "--optimizers", "adamw,dmuon:muon"]) == 0
    path = tmp_path / "train-grid-cpu-quick.json"
    first = json.loads(path.read_text())
    muon = {k: r for k, r in first["runs"].items() if r["optimizer"] == "dmuon:muon"}
    capsys.readouterr()
    with pytest.raises(SystemExit, match="needs --resume"):
        main([*args, "--optimizers", "dmuon:muon", "--rerun", "dmuon:muon"])
    with pytest.raises(SystemExit, match="not in --optimizers"):
        main([*args, "--optimizers", "dmuon:muon", "--resume", "--rerun", "adamw"])
    assert main([*args, "--optimizers", "dmuon:muon", "--resume", "--rerun", "dmuon:muon"]) == 0
    out = capsys.readouterr().out
    assert "dmuon:muon lr=" in out and "adamw lr=" not in out
    again = json.loads(path.read_text())
    assert sorted(r["lr"] for r in again["superseded"]) == sorted(r["lr"] for r in muon.values())
    assert all(r["invocation"] == 0 for r in again["superseded"])
    assert {r["invocation"] for r in again["runs"].values() if r["optimizer"] == "dmuon:muon"} == {
        1
    }
    # Same code, same seed, same thread count: the rerun reproduces the old losses.
    for key, run in muon.items():
        assert again["runs"][key]["curve"]["val_loss"] == run["curve"]["val_loss"]
    assert set(again["summary"]["rows"]) == {"adamw", "dmuon:muon"}


def test_incomplete_grid_is_marked_not_reported_as_final(tmp_path, text, capsys):
    args = [*TINY, "--data", str(text), "--out", str(tmp_path), "--no-plots"]
    assert main([*args, "--optimizers", "adamw,dmuon:muon"]) == 0
    path = tmp_path / "train-grid-cpu-quick.json"
    result = json.loads(path.read_text())
    # A grid stopped part-way: Muon's seed-1 rerun and one of its grid points missing.
    muon = [k for k, r in result["runs"].items() if r["optimizer"] == "dmuon:muon"]
    best = result["summary"]["rows"]["dmuon:muon"]["best_lr"]
    drop = [k for k in muon if k.endswith("|1")]
    drop += [k for k in muon if k.endswith("|0") and not k.startswith(f"dmuon:muon|{best:.6g}|")][
        :1
    ]
    for k in drop:
        del result["runs"][k]
    path.write_text(json.dumps(result))
    capsys.readouterr()
    assert main([*args, "--optimizers", "adamw,dmuon:muon", "--report", "--markdown"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| `dmuon:muon`"))
    assert "incomplete:" in row and "best so far" in row
    assert f"| {best:.2g} |" not in row  # the best point so far is not shown as the result
    assert "Incomplete grids, their best point not final: `dmuon:muon`" in out
    adamw = next(line for line in out.splitlines() if line.startswith("| `adamw`"))
    assert "incomplete" not in adamw
    assert json.loads(path.read_text()) == result  # --report writes nothing
    # Resuming runs exactly what is missing, and the grid is complete again.
    assert main([*args, "--optimizers", "adamw,dmuon:muon", "--resume"]) == 0
    again = json.loads(path.read_text())
    assert set(again["runs"]) == set(result["runs"]) | set(drop)
    assert again["summary"]["rows"]["dmuon:muon"]["complete"] is True


def test_plots_one_line_per_optimizer(tmp_path, text):
    args = [*TINY, "--data", str(text), "--out", str(tmp_path), "--seeds", "0"]
    assert main([*args, "--optimizers", "adamw,dmuon:muon"]) == 0
    for suffix in ("val-vs-step", "val-vs-time", "lr"):
        assert (tmp_path / f"train-grid-cpu-quick-{suffix}.png").stat().st_size > 1000


def test_center_of_an_optimizer_with_options(tmp_path, text):
    args = [*TINY, "--data", str(text), "--out", str(tmp_path), "--no-plots", "--seeds", "0"]
    spec = "dmuon:musec+clip_tau=0.5"
    assert main([*args, "--optimizers", spec, "--center", f"{spec}=0.005"]) == 0
    result = json.loads((tmp_path / "train-grid-cpu-quick.json").read_text())
    lrs = sorted({r["lr"] for r in result["runs"].values()})
    assert any(lr == pytest.approx(0.005) for lr in lrs)  # not in the default grid
    assert all(r["rule_options"] == {"clip_tau": 0.5} for r in result["runs"].values())
