"""What the benchmarks write beside their figures: the machine record the house rule asks
for (CPU model, native bf16, torch and triton versions, world size, threads per rank,
commit), result files named by ``--tag``, and output locations given on the command line
(a run must not have to write into ``benchmarks/results``).

The references are read another way than the code under test: the CPU model from
``/proc/cpuinfo``, triton's version from its distribution metadata, the threads from the
ranks themselves. Times are never asserted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib

import pytest
import torch

from benchmarks import comm, faults, kernels, ns_compile, plan_published, soak, step
from benchmarks.common import metrics
from dmuon.comm.testing import run_on_ranks


def _cpu_model() -> str | None:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def _triton() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _rank_threads(rank: int, world: int) -> int:
    return torch.get_num_threads()


def test_machine_info_records_triton_world_and_the_ranks_threads():
    ranks = run_on_ranks(_rank_threads, 2, timeout=120, threads_per_rank=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the launcher's count differs from the ranks'
    try:
        info = metrics.machine_info("cpu", world_size=2, threads_per_rank=1)
    finally:
        torch.set_num_threads(before)
    assert info["triton"] == _triton()
    assert info["world_size"] == 2
    assert info["torch_threads"] == info["threads_per_rank"] == ranks[0] == 1
    assert info["launcher_torch_threads"] == 2
    for key in ("cpu", "cpu_native_bf16", "torch", "git_commit"):
        assert key in info, key


def test_file_tag_makes_a_suffix_and_refuses_what_cannot_name_a_file():
    assert [metrics.file_tag(t) for t in ("", "bf16", "-bf16")] == ["", "-bf16", "-bf16"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"--tag .* got 'a/b'"):
        metrics.file_tag("a/b")


def test_kernels_tag_names_the_files(tmp_path):
    assert kernels.main(["--dry-run", "--tag", "nobf16", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kernels-cpu-dry-run-nobf16.json",
        "kernels-cpu-dry-run-nobf16.png",
    ]
    meta = json.loads((tmp_path / "kernels-cpu-dry-run-nobf16.json").read_text())["meta"]
    assert meta["triton"] == _triton()


def test_step_single_tag_names_the_files(tmp_path):
    argv = ["--single", "--dry-run", "--threads", "1", "--rules", "muon", "--tag=-bf16"]
    assert step.main([*argv, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "step-single-cpu-dry-run-1thread-bf16.json").is_file()


def test_comm_records_the_shared_machine_record(tmp_path):
    argv = ["--world-sizes", "2", "--layers", "1", "--d-model", "32", "--repeats", "1"]
    assert comm.main([*argv, "--tag", "quick", "--out", str(tmp_path)]) == 0
    meta = json.loads((tmp_path / "comm-cpu-gloo-w2-quick.json").read_text())["meta"]
    assert meta["cpu"] == _cpu_model()  # not platform.machine()'s "x86_64"
    assert meta["world_size"] == 2 and meta["threads_per_rank"] == 1
    assert meta["backend"] == "gloo"
    for key in ("cpu_native_bf16", "git_commit", "triton"):
        assert key in meta, key


def test_faults_writes_where_out_says_with_the_machine(tmp_path):
    out = tmp_path / "sub" / "faults.json"
    assert faults.main(["--cases", "owner:kill", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {(r["mode"], r["fault"]) for r in result["rows"]} == {("owner", "kill")}
    assert result["machine"]["world_size"] == faults.WORLD
    assert result["machine"]["threads_per_rank"] == 1


def test_plan_published_writes_where_out_says_with_the_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_published, "PUBLISHED", plan_published.PUBLISHED[:1])
    out = tmp_path / "published.json"
    assert plan_published.main(["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 1 and result["machine"]["cpu"] == _cpu_model()


def test_soak_command_leaves_out_the_machines_paths():
    argv = ["--steps", "8", "--out", "work", "--results=res", "--results", "r2", "--kills", "1"]
    assert soak._command(argv) == "python benchmarks/soak.py --steps 8 --kills 1"


def test_ns_compile_records_the_machine(tmp_path):
    out = tmp_path / "ns.json"
    assert ns_compile.main(["--shapes", "1x8x32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"1x8x32"}
    machine = result["machine"]
    assert machine["cpu"] == _cpu_model() and machine["torch_threads"] == 1
    assert "cpu_native_bf16" in machine and "git_commit" in machine
