"""``dmuon-plan``: JSON against the schema, table, plot, errors, calibration.

The entry point runs end to end in a subprocess (``python -m dmuon.optim.planner``) for
the JSON, the piped table with its plot, calibration and one bad input; the other cases
call the same ``main`` in this process (a subprocess costs three seconds of imports).
"""

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from dmuon.optim.planner.report import SCHEMA, validate

HERE = pathlib.Path(__file__).parent


def run(*args, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "dmuon.optim.planner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def call(*args):
    """``main(args)`` in this process, as a ``CompletedProcess`` (exit status, outputs)."""
    from dmuon.optim.planner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_json_output_validates_against_the_documented_schema():
    done = run("llama-3.1-8b", "--gpus", "64", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    validate(out)
    assert set(out["modes"]) == {
        "adamw", "vanilla", "owner", "owner-z3", "owner-ddp", "owner-ddp-zero1", "replicated",
        "sharded", "sign",
    }  # fmt: skip
    assert out["modes"]["owner"]["tp_ms"] == 0 and out["cluster"]["tp"] == 1
    assert out["model"]["total_params"] == 8_030_261_248
    assert out["plan"]["world_size"] == 64
    assert out["modes"]["owner"]["ns_ms"] < out["modes"]["vanilla"]["ns_ms"]
    assert any(a["what"] == "NS kernel efficiency" for a in out["assumptions"])


def test_owner_ddp_zero1_mode_is_accepted_and_its_json_validates():
    # ddp.dedicate(scalars="owner"): --mode takes it, alone or beside owner-ddp
    done = call("gpt2", "--gpus", "4", "--mode", "owner-ddp,owner-ddp-zero1", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    validate(out)
    assert set(out["modes"]) == {"adamw", "vanilla", "owner-ddp", "owner-ddp-zero1"}
    zero1, ddp = out["modes"]["owner-ddp-zero1"], out["modes"]["owner-ddp"]
    assert zero1["memory_bytes"]["optimizer_state"] < ddp["memory_bytes"]["optimizer_state"]
    assert {t["op"] for t in zero1["transfers"]} == {
        "reduce_to_owners", "broadcast_from_owners", "presence_flags",
    }  # fmt: skip
    done = call("gpt2", "--gpus", "4", "--mode", "owner-ddp-zero1")
    assert done.returncode == 0, done.stderr
    assert any(x.strip().startswith("owner-ddp-zero1 ") for x in done.stdout.splitlines())


def test_tensor_parallel_json_validates_and_reports_the_tp_terms():
    done = call("llama-3.2-3b", "--gpus", "16", "--tp", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    validate(out)
    assert (out["cluster"]["dp"], out["cluster"]["tp"], out["plan"]["world_size"]) == (8, 2, 8)
    for mode in ("owner", "owner-z3", "replicated", "sharded", "sign"):
        assert out["modes"][mode]["bytes_per_rank_tp"] > 0, mode
        assert out["modes"][mode]["tp_ms"] > 0, mode
    assert out["modes"]["adamw"]["bytes_per_rank_tp"] == 0
    gathers = [t for t in out["modes"]["vanilla"]["transfers"] if t["op"] == "tp_gather_gradients"]
    assert len(gathers) == 1 and gathers[0]["bytes_per_rank_max"] > 0
    assert any(a["what"] == "tensor-parallel path" for a in out["assumptions"])


def test_the_schema_validator_rejects_what_does_not_fit():
    done = call("gpt2", "--gpus", "4", "--mode", "owner", "--json")
    out = json.loads(done.stdout)
    validate(out)
    del out["modes"]["owner"]["step_ms"]
    with pytest.raises(ValueError, match=r"\$\.modes\.owner: missing required field 'step_ms'"):
        validate(out, SCHEMA)
    out = json.loads(done.stdout)
    out["modes"]["adamw"]["transfers"][0]["phase"] = "later"
    with pytest.raises(ValueError, match="expected one of"):
        validate(out)


def test_plain_table_when_piped_and_plot(tmp_path):
    png = tmp_path / "overhead.png"
    done = run("qwen2.5-1.5b", "--gpus", "16", "--device", "A800", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "owner plan: 16 ranks, imbalance" in text and "assumptions:" in text
    assert "\x1b[" not in text  # no terminal escapes when piped
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_factory_model():
    done = call("planner_factories:tiny", "--gpus", "2", "--json", "--mode", "owner,sharded")
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["modes"]) == {"adamw", "vanilla", "owner", "sharded"}


def test_module_factory_found_in_the_current_directory(monkeypatch, tmp_path):
    # The dmuon-plan console script's sys.path starts at its bin directory, not the current
    # one (as `python -m` does): `dmuon-plan mymodel:build` next to mymodel.py said "No
    # module named 'mymodel'". The factory's module is looked up in the current directory.
    (tmp_path / "plan_cwd_model.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Linear(64, 32)\n"
    )
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != cwd]
    )
    monkeypatch.delitem(sys.modules, "plan_cwd_model", raising=False)
    path_before = list(sys.path)
    done = call("plan_cwd_model:build", "--gpus", "2", "--json", "--mode", "owner")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"]["matrices"] == 1
    assert sys.path == path_before  # the directory is not left on the path
    sys.modules.pop("plan_cwd_model", None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["gpt2", "--inter", "0GB/s"], "bandwidth must be a finite number > 0"),
        (["gpt2", "--intra", "fast"], "--intra 'fast': give a preset"),
        # slower links gave inf and NaN figures
        (["gpt2", "--intra", "1e-300"], "give a bandwidth of at least 1MB/s"),
        # less than one sequence per step: fwd+bwd printed as 0.0 ms
        (["gpt2", "--tokens", "100", "--seq-len", "4096"], "--tokens 100 is less than one"),
        (["gpt2", "--mode", "zero"], "--mode must be 'all' or among"),
        (["gpt2", "--gpus", "0"], "gpus must be an int ≥ 1"),
        (["gpt2", "--tp", "3"], "--tp 3 must divide --gpus 8"),
        (
            ["mixtral-8x7b", "--gpus", "8", "--tp", "2", "--ep", "8"],
            "--ep 8 must divide the data-parallel ranks gpus/tp = 8/2 = 4",
        ),
        (["llama-3.2-3b", "--ep", "2"], "--ep 2: llama-3.2-3b is a dense model"),
        (["gpt2", "--device", "TPU"], "neither a preset"),
        (["bert-base"], "neither a preset"),
        (["gpt2", "--fwd-bwd-ms", "inf"], "--fwd-bwd-ms) must be a finite number > 0"),
        (["gpt2", "--ns-steps", "0"], "--ns-steps) must be an integer ≥ 1"),
        (["json:loads"], "the factory raised TypeError"),
    ],
)
def test_bad_input_exits_2_naming_it(args, message):
    done = call(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_plot_without_matplotlib_exits_2_before_the_work(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    png = tmp_path / "overhead.png"
    done = call("gpt2", "--gpus", "4", "--plot", str(png))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "dmuon-plan: error: --plot needs matplotlib: pip install 'dmuon-optim[plan]'"
    )
    assert done.stdout == "" and not png.exists()  # refused before any table


def test_bad_input_exits_2_from_the_console_entry():
    done = run("gpt2", "--gpus", "0")
    assert done.returncode == 2 and "gpus must be an int ≥ 1" in done.stderr, done.stderr


def test_calibrate_writes_a_profile_that_later_runs_load(tmp_path):
    profile = tmp_path / "cpu.json"
    done = run(
        "planner_factories:tiny", "--calibrate", str(profile), "--calibrate-device", "cpu",
        "--gpus", "2", "--gpus-per-node", "2", "--json", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(profile.read_text())
    assert data["peak_flops"] > 0 and 0 < data["ns_efficiency"] <= 1
    assert data["measured"]["link"]["backend"] == "gloo"
    assert data["measured"]["link"]["bandwidth"] > 0
    # FSDP2's collectives measured on their own (gloo's differ from its all-reduce)
    assert set(data["measured"]["link"]["bandwidth_by_collective"]) == {
        "all_gather",
        "reduce_scatter",
    }
    assert min(data["measured"]["link"]["bandwidth_by_collective"].values()) > 0
    # Sign-Muon's chain beyond Muon's, and the vote's own work on real ranks, measured
    assert data["sign_overhead"] >= 0 and data["vote_overhead"] >= 0
    assert data["vote_overhead"] == data["measured"]["link"]["vote_seconds_per_element"]
    out = json.loads(done.stdout)
    assert out["cluster"]["intra"]["name"] == "measured"
    again = run("planner_factories:tiny", "--device", str(profile), "--gpus", "2", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["cluster"]["device"]["name"].startswith("cpu")


def guide_example(*extra: str) -> tuple[list[str], str]:
    """The planning guide's Llama-3.1-8B command (with ``extra`` flags) run, its output
    lines, and the guide's text with whitespace collapsed; checks its first three lines
    (model, cluster and plan summary) appear in the guide verbatim."""
    guide = HERE.parents[2] / "docs" / "guides" / "planning.md"
    if not guide.is_file():  # an installed package's tests, without the repository
        pytest.skip("docs/guides/planning.md is not next to these tests")
    done = call(
        "llama-3.1-8b", "--gpus", "64", "--gpus-per-node", "8", "--device", "H100",
        "--inter", "ib-ndr", "--tokens", "4194304", "--seq-len", "4096", "--mfu", "0.4",
        *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = guide.read_text()
    lines = done.stdout.splitlines()
    for line in lines[:3]:
        assert line in text, line
    return lines, " ".join(text.split())


MODES_SHOWN = (
    "adamw", "vanilla", "owner", "owner-z3", "owner-ddp", "owner-ddp-zero1", "replicated",
    "sharded", "sign",
)  # fmt: skip


def test_the_guides_example_prints_what_the_guide_shows():
    """Every mode's row as far as the guide shows it (up to framework MB/rank): a figure
    the code no longer prints (the sign row's bytes stayed at 8 votes a byte after the
    packing became 5) fails here."""
    lines, flat = guide_example()
    for mode in MODES_SHOWN:
        row = next(x for x in lines if x.strip().startswith(mode + " "))
        assert " ".join(row.split()[:11]) in flat, row


def test_the_guides_tensor_parallel_example_prints_what_the_guide_shows():
    lines, flat = guide_example("--tp", "8")
    for mode in MODES_SHOWN:
        row = next(x for x in lines if x.strip().startswith(mode + " "))
        assert " ".join(row.split()[:13]) in flat, row  # up to the TP MB/rank column


@pytest.mark.parametrize("tp", [1, 8])
def test_the_owner_plan_line_states_owner_modes_work_per_rank(tp):
    # the line's max and mean are owner mode's per-rank Newton–Schulz (and tp) time in the
    # engine's calls, the busiest rank's being owner mode's NS + TP; plan_owners' own loads
    # (same-shape matrices batched across layers) follow "as planned"
    from dmuon.optim.planner.config import load_model
    from dmuon.optim.planner.profiles import DEVICES, INTERCONNECTS, ClusterProfile
    from dmuon.optim.planner.report import format_report, to_json
    from dmuon.optim.planner.step_model import TrainingShape, predict

    cluster = ClusterProfile(DEVICES["H100"], 64, 8, INTERCONNECTS["nvlink4"],
                             INTERCONNECTS["ib-ndr"])  # fmt: skip
    p = predict(load_model("llama-3.2-3b"), cluster, TrainingShape(tp=tp), modes=("owner",))
    owner = p.modes["owner"]
    assert len(p.owner_loads) == p.plan.world_size
    assert max(p.owner_loads) == pytest.approx(owner.ns_s + owner.tp_s, rel=1e-12)
    line = next(x for x in format_report(p, pretty=False).splitlines() if "owner plan" in x)
    assert f"max {max(p.owner_loads) * 1e3:.2f} ms" in line, line
    assert "as planned, batched across layers" in line and f"{p.plan.max_load * 1e3:.2f}" in line
    plan = to_json(p)["plan"]
    assert plan["owner_max_load_ms"] == pytest.approx(max(p.owner_loads) * 1e3)
    assert plan["max_load_ms"] == pytest.approx(p.plan.max_load * 1e3)
