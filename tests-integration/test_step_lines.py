"""A step's Python work grows linearly with the model's depth, in every DMuon mode.

``benchmarks/step_lines.py`` counts the Python lines the ``dmuon`` packages execute
in one warm training step (and the next forward) on 2 gloo ranks; the lines each
added layer adds must be the same from 8 to 16 layers as from 4 to 8. Each of these
failed before its fix (rank 0's lines per added layer, 4→8 then 8→16):

* owner mode looked for each layer's scalar parameters among all of them, and each
  forward pre-hook waited on the publications from the first layer on;
* ``replicated``, ``sharded`` and ``sign`` listed each layer's matrices by scanning
  every parameter (``PlannedEngine.matrices(key)``).

Counts, not times: the figures depend on the code only.
"""

from __future__ import annotations

import pytest

from benchmarks import step_lines


@pytest.mark.parametrize("setup", step_lines.DMUON_SETUPS)
def test_lines_per_step_grow_linearly_with_depth(setup):
    lines = {n: step_lines.lines_per_step(setup, n, d_model=16, timeout=120)[0] for n in (4, 8, 16)}
    first, second = step_lines.growth(lines)
    assert first > 0 and abs(second - first) <= 0.01 * first, (setup, lines)


def test_the_table_names_every_setup_and_depth(capsys, tmp_path):
    out = tmp_path / "lines.json"
    assert step_lines.main(["--setups", "owner_ddp", "--depths", "2", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| owner_ddp |" in printed and "per layer 2→3" in printed
    import json

    result = json.loads(out.read_text())
    assert set(result["lines"]["owner_ddp"]) == {"2", "3"}
    # the figures are the code's: the record names the commit and versions they are of
    machine = result["machine"]
    assert machine["world_size"] == 2 and machine["threads_per_rank"] == 1
    assert "git_commit" in machine and "triton" in machine
