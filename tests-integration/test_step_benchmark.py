"""``benchmarks/step.py --world N`` runs every setup at a tiny size and writes its results.

The benchmark's figures are reported, never asserted (tests do not time); what is
checked is that every setup — the opt-in ones too — builds, steps on 2 gloo ranks,
and lands in the JSON with its phases, and that the owner-mode setups split the
matrices between the ranks (the plan the step ratios rest on).
"""

from __future__ import annotations

import json

from benchmarks import step, step_world


def test_every_setup_steps_on_two_ranks_and_is_written(tmp_path):
    setups = [s for s in step_world.SETUPS if s != "torch_muon_ddp"]  # bf16 NS: minutes on CPU
    argv = ["--world", "2", "--quick", "--steps", "2", "--out", str(tmp_path), "--setups", *setups]
    assert step.main(argv) == 0
    result = json.loads((tmp_path / "step-world2-cpu-quick.json").read_text())
    assert (tmp_path / "step-world2-cpu-quick.png").stat().st_size > 10_000
    assert sorted(result["rows"]) == sorted(setups)
    for name, row in result["rows"].items():
        assert set(row["seconds"]) == set(step_world.PHASES), name
        assert row["total"] > 0 and len(row["all_totals"]) == 2, name
    for name in ("owner_fsdp", "owner_ddp", "owner_ddp_zero1"):
        per_rank = result["rows"][name]["matrices_per_rank"]
        assert sum(per_rank) == 8 and min(per_rank) > 0, (name, per_rank)
    assert result["rows"]["muon_vanilla"]["matrices_per_rank"] == [8, 8]
