"""``benchmarks/step_files.py`` records one warm owner-mode step and writes its figures.

The counts themselves are the benchmark's output (they change with the code and
are quoted in ``docs/development/architecture.md``), never asserted; what is
checked is that the script runs on 2 gloo ranks within its timeout and writes a
JSON whose figures agree with the call sequence it recorded.
"""

from __future__ import annotations

import itertools
import json

from benchmarks import step_files


def test_step_files_writes_the_figures_of_each_rank(tmp_path, capsys):
    out = tmp_path / "step-files.json"
    assert step_files.main(["--json", str(out), "--timeout", "120"]) == 0
    result = json.loads(out.read_text())
    assert result["world"] == 2 and len(result["ranks"]) == 2
    machine = result["machine"]  # which commit and versions the files are of
    assert machine["world_size"] == 2 and machine["threads_per_rank"] == 1
    assert "git_commit" in machine and "triton" in machine
    for rank in result["ranks"]:
        sequence = rank["sequence"]
        assert all(f.startswith("dmuon/") and f.endswith(".py") for f in sequence)
        assert all(a != b for a, b in itertools.pairwise(sequence)), "repeats are folded"
        assert rank["files"] == len(set(sequence))
        assert rank["hops"] == len(sequence) - 1
        assert 0 <= rank["package_crossings"] <= rank["hops"]
        assert rank["optimizer_entries"] == sequence.count("dmuon/optim/optimizer.py")
        by_package = rank["files_by_package"]
        assert set(by_package) == set(step_files.PACKAGES)
        assert sorted(f for files in by_package.values() for f in files) == sorted(set(sequence))
    assert "package crossings" in capsys.readouterr().out
