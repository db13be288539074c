"""``benchmarks/step_overhead.py --quick`` runs every setup at a tiny size and writes its
results. The figures are reported, never asserted (tests do not time): what is checked
is the JSON's structure — every setup at every depth, its quartiles, per-parameter
figures, slope and ratio, and the machine it ran on.
"""

from __future__ import annotations

import json

from benchmarks import step_overhead


def test_quick_run_writes_every_setup_and_the_machine(tmp_path):
    assert step_overhead.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step-overhead-cpu-quick.json").read_text())
    assert (tmp_path / "step-overhead-cpu-quick.png").stat().st_size > 10_000
    depths = [str(d) for d in result["depths"]]
    assert len(depths) >= 2 and result["world"] == 2
    assert result["params"] == {d: step_overhead.params_of(int(d)) for d in depths}
    rows = result["rows"]
    assert set(rows) == set(step_overhead.SINGLE_SETUPS) | set(step_overhead.WORLD_SETUPS)
    for name in step_overhead.SINGLE_SETUPS:
        row = rows[name]
        assert row["kind"] == "single", name
        for d in depths:
            q = row["us_per_step"][d]
            assert set(q) == {"median", "p25", "p75"}, name
            assert 0 < q["p25"] <= q["median"] <= q["p75"], (name, q)
            assert row["us_per_param"][d] > 0 and row["ratio_to_adamw"][d] > 0
        assert isinstance(row["slope_us_per_param"], float)
    assert all(r == 1.0 for r in rows["adamw"]["ratio_to_adamw"].values())
    for name in step_overhead.WORLD_SETUPS:
        row = rows[name]
        assert row["kind"] == "world", name
        for d in depths:
            assert set(row["us_per_step"][d]) == set(step_overhead.PHASES), name
            assert row["us_per_step"][d]["step"]["median"] > 0, name
            assert d in row["hooks_us_per_param"], name
        assert isinstance(row["backward_slope_us_per_param"], float)
    assert set(rows["dmuon_owner"]["ratio_to_adamw_ddp"]) == set(depths)
    meta = result["meta"]
    for key in ("cpu", "cpu_native_bf16", "torch", "torch_threads", "load_average_1min", "date"):
        assert key in meta, key
    assert meta["torch_threads"] == 1
