"""No committed result or page carries a path of the machine it was made on.

A figure's provenance is the project's own command, which anyone can run; an absolute
path of an author's checkout, home or output folder (``/work/main/...``, ``/root/out``,
a virtual environment's interpreter) says nothing to them. ``gpu_run.py`` and
``gpu_check.py`` record their commands with ``python``, paths relative to the
repository and ``$OUT`` (before: ``/work/main/benchmarks/gpu_check.py --out /root/out``
and ``/opt/torch/.venv/bin/python3`` were committed in ``benchmarks/results``).
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"(?<![\w.$-])/(?:work|root|home|opt|Users|mnt|scratch)/[\w.-]+")


def _committed_texts() -> list[pathlib.Path]:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    files += [p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.suffix == ".json"]
    return files


def test_no_result_or_page_names_a_path_of_the_authors_machine():
    found = []
    for path in _committed_texts():
        for match in MACHINE_PATH.finditer(path.read_text(errors="replace")):
            found.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not found, "machine paths committed:\n" + "\n".join(found[:20])


def test_the_gpu_tools_record_their_commands_without_machine_paths(monkeypatch):
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_run import shown

    monkeypatch.setenv("OUT", "/srv/device/out")
    script = str(ROOT / "benchmarks" / "step.py")
    got = shown([sys.executable, script, "--out", "/srv/device/out", "--single"])
    assert got == "python benchmarks/step.py --out $OUT --single", got
