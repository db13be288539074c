"""``benchmarks/profile_ns.py --device cuda`` profiles eager calls, not CUDA-graph replays.

DMuon replays its Newton–Schulz calls from CUDA graphs by default on a GPU, and a
replay shows the profiler no ``aten::`` operators: the per-operator breakdown of
DMuon's rows would read about zero. The script turns graphs off while it profiles,
says so, records it in the JSON, and restores the process's setting afterwards.

No GPU here: the cases are replaced by stand-ins that record whether graphs were on
when they ran (what the real cases would have captured).
"""

from __future__ import annotations

import json

import torch

import benchmarks.profile_ns as profile_ns
from dmuon.kernels import cuda_graphs_enabled
from dmuon.kernels.cuda_graphs import graph_cache


def test_cuda_profile_runs_every_case_with_graphs_off(monkeypatch, tmp_path, capsys):
    seen = []

    def case(name):
        def run(*args, **kwargs):
            seen.append((name, cuda_graphs_enabled()))
            return [{"case": name, "wall_ms": 1.0, "profiled_ms": 1.0, "groups_ms": {}}]

        return run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile_ns, "ns_cases", case("orthogonalize"))
    monkeypatch.setattr(profile_ns, "step_cases", case("step"))
    monkeypatch.setattr(profile_ns, "machine_info", lambda device: {"device": device})
    monkeypatch.setattr(graph_cache(), "enabled", True)  # the default, whatever the env says
    assert profile_ns.main(["--device", "cuda", "--out", str(tmp_path)]) == 0
    assert seen == [("orthogonalize", False), ("step", False)]
    assert cuda_graphs_enabled()  # restored
    assert "CUDA graphs off while profiling" in capsys.readouterr().out
    meta = json.loads((tmp_path / "profile-cuda.json").read_text())["meta"]
    assert meta["cuda_graphs"] is False
