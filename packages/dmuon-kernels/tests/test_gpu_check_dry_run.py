"""benchmarks/gpu_check.py --dry-run: the GPU check's plan, every measurement path and its
JSON writer, on a CPU (tiny shapes, Triton interpreter). The real run needs a GPU."""

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

pytestmark = pytest.mark.skipif(
    not SCRIPT.exists(), reason="benchmarks/gpu_check.py is not in this tree (sdist)"
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "gpu-check-dry-run-quick.json").read_text()), out


def test_json_holds_versions_plan_and_every_figure(dry_run):
    _, result, out = dry_run
    meta = result["meta"]
    assert meta["dry_run"] is True and meta["device"] == "cpu"
    assert {"torch", "triton", "dmuon_kernels", "date"} <= set(meta)
    # the full GPU plan: Llama-3-8B shapes and batches, every method × backend × graphs
    shapes = {(c["batch"], c["rows"], c["cols"]) for c in result["plan"]["ns"]}
    assert {(1, 4096, 4096), (1, 1024, 4096), (1, 14336, 4096)} <= shapes
    assert any(b > 1 for b, _, _ in shapes)
    combos = {(c["method"], c["backend"], c["graphs"]) for c in result["plan"]["ns"]}
    assert len(combos) == 2 * 3 * 2
    assert {(c["op"], c["m"], c["k"]) for c in result["plan"]["kernels"]} >= {
        ("syrk", 4096, 14336),
        ("sym_poly", 4096, 4096),
        ("sym_mul", 4096, 4096),
    }
    assert result["plan_check"]["peak_memory_gib_estimate"] < 64
    # every executed case produced its figures
    assert len(result["kernels"]) == len(result["executed_plan"]["kernels"])
    for row in result["kernels"]:
        assert row["status"] == "ok" and row["triton_ms"] > 0 and row["torch_ms"] > 0
        assert row["max_rel_diff"] < 0.05  # interpreter vs torch: rounding only
    ns = result["ns"]
    assert len(ns) == len(result["executed_plan"]["ns"])
    for row in ns:
        if row["graphs"]:
            assert row["status"] == "skipped: CUDA graphs need CUDA"
        else:
            assert row["status"] == "ok" and row["ms"] > 0 and row["flops"] > 0
    assert {r["auto_decision"]["winner"] for r in ns if r["backend"] == "auto" and "ms" in r} == {
        "torch"  # auto off CUDA
    }
    assert set(result["summary"]["targets"]) == {
        "syrk_speedup_4096x14336",
        "gram_triton_vs_standard_torch_14336x4096",
        "ns_fraction_of_gemm_rate",
    }
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "gpu-check-dry-run-quick.png").exists()


def test_prints_the_tables_and_says_it_is_a_dry_run(dry_run):
    stdout, _, _ = dry_run
    assert "DRY RUN" in stdout
    assert "Symmetric kernels vs torch" in stdout and "orthogonalize" in stdout
    assert "Targets:" in stdout


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_gpu_tests_are_the_files_that_run_cuda_code():
    """The GPU check runs only the kernel tests that exercise CUDA (the whole suite took
    ~2 min on an H200, past the step's limit): every file that takes tritonref's DEVICE
    or COMPILED, or asks torch.cuda whether a device is there, and no other."""
    here = pathlib.Path(__file__).parent
    cuda = re.compile(
        r"from tritonref import [^\n]*\b(DEVICE|COMPILED)\b"
        r"|torch\.cuda\.(is_available|device_count)\("
    )
    found = {f.name for f in here.glob("test_*.py") if cuda.search(f.read_text())}
    found.discard(pathlib.Path(__file__).name)  # this file names the pattern
    assert tuple(sorted(found)) == _gpu_check_module().GPU_TESTS


def test_a_test_run_past_its_limit_keeps_the_tail_of_its_output(tmp_path):
    """At the limit pytest gets SIGINT: the JSON keeps what it printed, where it was —
    also when the launcher ignores SIGINT (run in the background, as CI and the device
    tool run it: its children inherit the ignored signal, and pytest never stopped)."""
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n"
    )
    check = _gpu_check_module()
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "test_slow.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = check.run_limited(command, 8.0, env, tmp_path)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert result["status"] == "timed out after 8 s"
    assert result["seconds"] < 30
    assert "test_fast PASSED" in result["output_tail"]
    assert "KeyboardInterrupt" in result["output_tail"] and "test_slow" in result["output_tail"]


def test_out_defaults_to_the_gpu_tools_folder(monkeypatch, tmp_path):
    check = _gpu_check_module()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert check.parse_args([]).out == tmp_path
    monkeypatch.delenv("OUT")
    assert check.parse_args([]).out == ROOT / "benchmarks" / "results"
