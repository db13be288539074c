"""docs/development/gpu.md lists the time limits ``benchmarks/gpu_run.py`` gives its steps.

The GPU machine is lent for 15 minutes a session, so whoever plans a GPU run reads the
limits from that page; they went stale once (7 and 4 steps listed with other numbers
than the code's 8 and 5). The table under the ``gpu-run-limits`` marker is compared,
step by step and in order, with ``steps("full")`` and ``steps("quick")``, and its total
row with their sums.
"""

from __future__ import annotations

import pathlib
import re

import benchmarks.gpu_run as gpu_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "development" / "gpu.md"


def documented_limits() -> tuple[dict[str, float | None], dict[str, float | None], list[str]]:
    """The table after the marker: ``{step: full}``, ``{step: quick}`` (None: not run),
    and the total row's cells."""
    text = PAGE.read_text()
    assert "<!-- gpu-run-limits" in text, "gpu.md: the marked table of step limits is missing"
    marker = text.index("<!-- gpu-run-limits")
    rows = []
    for line in text[marker:].splitlines()[1:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, _, *body = rows
    assert header == ["step", "full", "quick"]

    def number(cell: str) -> float | None:
        return None if cell == "—" else float(cell.strip("*"))

    full, quick, total = {}, {}, []
    for name, f, q in body:
        if name == "**total**":
            total = [f, q]
            continue
        step = re.fullmatch(r"`(\w+)`", name)
        assert step, f"gpu.md: a step's name in backquotes, got {name!r}"
        full[step[1]], quick[step[1]] = number(f), number(q)
    return full, quick, total


def test_gpu_md_lists_the_step_limits_of_gpu_run():
    full, quick, total = documented_limits()
    out = pathlib.Path("/nonexistent")
    code = {
        mode: [(n, limit) for n, _, limit in gpu_run.steps(mode, out)] for mode in ("full", "quick")
    }
    assert [(n, v) for n, v in full.items() if v is not None] == code["full"]
    assert [(n, v) for n, v in quick.items() if v is not None] == code["quick"]
    sums = [sum(limit for _, limit in code[mode]) for mode in ("full", "quick")]
    assert [float(c.strip("*")) for c in total] == sums
    # within a session's 15 minutes, with room for a quick rerun
    assert sums[0] + sums[1] <= 15 * 60 - 120
