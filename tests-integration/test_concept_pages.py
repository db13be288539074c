"""Drift-prone claims of the Concepts pages, Getting started and Reliability match the code.

Each test reads a page and the code it describes and fails when one changes without
the other: the keyword defaults of ``orthogonalize`` (Getting started), the execution
modes (Execution modes), the planner's defaults and the closed-form FLOP count
(Owners and load balancing), the FLOP table and the autotuner's cross-check
tolerances (Newton–Schulz), the ``timeout="auto"`` deadline (Reliability) and the test
files that Reliability, Execution modes and Mixed precision name.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import torch

from dmuon.comm import plan_owners
from dmuon.kernels import ns_flops, orthogonalize
from dmuon.kernels.autotune import CROSS_CHECK_TOLERANCE
from dmuon.optim import deadline
from dmuon.optim.engine.modes import MODES

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return (DOCS / name).read_text()


def table_rows(markdown: str, header: str) -> list[list[str]]:
    """The cells of the rows of the table whose header line starts with ``header``."""
    m = re.search(rf"^{re.escape(header)}.*\n\|[-| ]+\|\n((?:\|.*\|\n)+)", markdown, re.M)
    assert m, f"no table with the header {header!r}"
    return [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in m.group(1).splitlines()
    ]


def test_getting_started_lists_the_defaults_of_orthogonalize():
    rows = table_rows(page("getting-started.md"), "| keyword | default | meaning |")
    documented = {re.fullmatch(r"`(\w+)`", r[0]).group(1): r[1] for r in rows}  # type: ignore[union-attr]
    signature = inspect.signature(orthogonalize).parameters
    shown = {k for k in signature if k not in ("G", "backend", "cuda_graph")}
    assert set(documented) == shown, "the keyword table of getting-started.md"
    for key, cell in documented.items():
        default = signature[key].default
        if key == "compute_dtype":  # None: chosen per device and method
            assert default is None and cell == "per device", cell
            continue
        if key == "restarts":  # None: chosen per compute dtype (default_restarts)
            assert default is None and cell == "per dtype", cell
            continue
        value = ast.literal_eval(cell.strip("`"))
        assert value == default and type(value) is type(default), (
            f"{key}: page {cell}, code {default!r}"
        )


def test_the_modes_table_lists_the_execution_modes_in_order():
    rows = table_rows(page("concepts/modes.md"), "| mode | gradients arrive as |")
    assert [re.match(r"`(\w+)`", r[0]).group(1) for r in rows] == list(MODES)  # type: ignore[union-attr]


def test_owners_page_states_the_planners_defaults():
    text = " ".join(page("concepts/owners.md").split())
    defaults = inspect.signature(plan_owners).parameters
    assert '`strategy="lpt"` (the default)' in text and defaults["strategy"].default == "lpt"
    pack = re.search(r"`pack_below` elements \(default `2\*\*(\d+)`", text)
    assert pack and 2 ** int(pack.group(1)) == defaults["pack_below"].default
    limit = re.search(r"`ilp_time_limit` seconds \(default (\d+)\)", text)
    assert limit and float(limit.group(1)) == defaults["ilp_time_limit"].default


def test_owners_page_gram_flop_formula_is_the_kernels_count():
    text = page("concepts/owners.md")
    assert "`4(1 + t)·s²l + (8·steps − 6 − 6t)·s³`" in text
    for m, n in [(64, 256), (300, 77), (128, 1024)]:
        s, l = min(m, n), max(m, n)
        for steps, restarts in [(5, (2,)), (5, (1, 3)), (6, (2, 4)), (4, ())]:
            t = len(restarts)
            closed = 4 * (1 + t) * s * s * l + (8 * steps - 6 - 6 * t) * s**3
            assert closed == ns_flops(m, n, steps=steps, restarts=restarts), (m, n, steps, restarts)
        assert ns_flops(m, n) == 8 * s * s * l + 28 * s**3  # "8s²l + 28s³ for five steps"


def test_newton_schulz_flop_table_is_the_kernels_count():
    rows = table_rows(page("concepts/newton-schulz.md"), "| `m × n` (5 steps) |")
    m = 64
    for cells in rows:
        e = 1 if "n = m" in cells[0] else int(re.search(r"n = (\d+)m", cells[0]).group(1))  # type: ignore[union-attr]
        standard = int(re.match(r"`(\d+) m³`", cells[1]).group(1))  # type: ignore[union-attr]
        gram = int(re.match(r"`(\d+) m³`", cells[2]).group(1))  # type: ignore[union-attr]
        assert ns_flops(m, e * m, method="standard") == standard * m**3, cells
        assert ns_flops(m, e * m) == gram * m**3, cells
        assert float(cells[3]) == round(gram / standard, 2), cells


def test_newton_schulz_page_states_the_cross_check_tolerances():
    text = " ".join(page("concepts/newton-schulz.md").split())
    m = re.search(
        r"tolerance \(largest difference over largest entry: (\S+) fp16, (\S+) bf16, (\S+) fp32;",
        text,
    )
    assert m, "the cross-check tolerances are no longer stated"
    stated = dict(
        zip((torch.float16, torch.bfloat16, torch.float32), map(float, m.groups()), strict=True)
    )
    assert stated == CROSS_CHECK_TOLERANCE


def test_reliability_page_states_the_auto_deadline():
    text = " ".join(page("reliability.md").split())
    m = re.search(r"`max\((\d+) s, (\d+) · slowest iteration\)`", text)
    assert m, "the formula of timeout='auto' is no longer stated"
    assert float(m.group(1)) == deadline.AUTO_FLOOR_SECONDS
    assert float(m.group(2)) == deadline.AUTO_ITERATION_FACTOR


def test_every_test_file_the_pages_name_exists():
    for name in ("reliability.md", "concepts/modes.md", "concepts/precision.md"):
        for path in set(re.findall(r"`((?:[\w-]+/)*test_\w+\.py)`", page(name))):
            where = ROOT / path if "/" in path else ROOT / "tests-integration" / path
            assert where.is_file(), f"{name} names {path}, which does not exist"
