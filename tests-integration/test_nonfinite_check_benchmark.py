"""``benchmarks/nonfinite_check.py`` at a tiny size: both forms of the owner step's
non-finite check give the same answer (the script raises otherwise) and the JSON has a
row per depth with both timings and the machine. Figures are reported, never asserted.
"""

from __future__ import annotations

import json

from benchmarks import nonfinite_check


def test_a_tiny_run_writes_both_forms_per_depth_and_the_machine(tmp_path):
    args = ["--depths", "2", "4", "--iterations", "1", "--repeats", "1", "--out", str(tmp_path)]
    assert nonfinite_check.main(args) == 0
    result = json.loads((tmp_path / "nonfinite-check-cpu.json").read_text())
    assert set(result["rows"]) == {"2", "4"}
    for depth, row in result["rows"].items():
        assert row["params"] == 4 * int(depth)
        assert row["all_us"] > 0 and row["vouched_us"] > 0 and row["ratio"] > 0
    for key in ("cpu", "cpu_native_bf16", "torch", "load_average_1min", "date"):
        assert key in result["machine"], key
    assert result["machine"]["world_size"] == 2 and result["machine"]["threads_per_rank"] == 1
