"""``benchmarks/experts.py --quick`` runs every setup on both layouts and writes its
results. The times are reported, never asserted (tests do not time); what is checked is
the JSON's structure and the matrices each rank orthogonalises, which the modes fix:
``single`` steps every dense matrix and its own experts on every rank, owner mode
(``ddp.dedicate``) fewer on ``dp × ep`` than ``replicated``, which plans the dense ones
over ``dp`` only.
"""

from __future__ import annotations

import json

from benchmarks import experts


def test_quick_run_writes_every_setup_of_both_layouts(tmp_path):
    assert experts.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "experts-cpu-quick.json").read_text())
    assert (tmp_path / "experts-cpu-quick.png").stat().st_size > 10_000
    assert result["machine"]["cores"] >= 1 and "cpu_native_bf16" in result["machine"]
    assert result["machine"]["threads_per_rank"] == 1  # the ranks', not the launcher's
    layouts = result["layouts"]
    assert set(layouts) == set(experts.LAYOUTS)
    size = result["size"]
    dense = 2 + 2 * size["layers"]  # input, output, and a router and an mlp per block
    local = size["experts"] // 2  # ep = 2 in both layouts
    for layout, res in layouts.items():
        rows = res["rows"]
        assert tuple(rows) == experts.setups_of(layout)
        for setup, row in rows.items():
            for phase in experts.PHASES:
                q = row[phase]
                assert 0 < q["p25"] <= q["median"] <= q["p75"], (layout, setup, phase, q)
            assert row["iteration_ratio_to_adamw"] > 0
        assert rows["adamw"]["most_orthogonalised"] == 0
        single = rows["single"]["orthogonalised_per_rank"]
        assert all(c == {"dense": dense, "experts": 2 * size["layers"] * local} for c in single)
        owner = rows["owner"]["orthogonalised_per_rank"]
        assert sum(c["dense"] for c in owner) == dense  # each dense matrix on one rank
    shares = layouts["dp×ep"]["rows"]
    assert shares["owner"]["most_orthogonalised"] <= shares["replicated"]["most_orthogonalised"]
