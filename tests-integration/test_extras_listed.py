"""Every place that lists the distributions' extras lists the ones their pyproject.toml
files declare, read from the sources (``test_release_docs.py`` checks the installed
metadata): an extra named in the docs, the READMEs or the noxfile exists, and every
declared extra is shown with its ``pip install`` in its distribution's README and
listed in ``docs/getting-started.md``. ``dmuon-optim`` once declared ``[fsdp]``, ``[deepspeed]``
and ``[hf]`` but not ``[lightning]`` or ``[torchtitan]``, which dmuon-integrations has."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ("dmuon-kernels", "dmuon-comm", "dmuon-optim", "dmuon-integrations")
# `dmuon-optim[hf]`, `"dmuon-integrations[lightning]"`: one distribution and its extra
NAMED = re.compile(r"\b(dmuon-(?:kernels|comm|optim|integrations))\[([\w-]+)\]")
# "`dmuon-optim`'s extras `[fsdp]`, `[deepspeed]` and `[hf]`": a sentence that lists them
LISTED = re.compile(
    r"`(dmuon-\w+)`(?:'s extras| has the extras)((?:[\s,]*(?:and\s+)?`\[[\w-]+\]`)+)"
)


def optional_dependencies(dist: str) -> dict[str, list[str]]:
    """``[project.optional-dependencies]`` of ``dist``'s pyproject.toml, from its lines
    ``name = ["spec", ...]`` (tomllib is Python 3.11+)."""
    text = (ROOT / "packages" / dist / "pyproject.toml").read_text()
    if "[project.optional-dependencies]" not in text:
        return {}
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {
        extra: re.findall(r'"([^"]+)"', specs)
        for extra, specs in re.findall(r"^([\w-]+) = \[(.*)\]$", section, re.M)
    }


def declared() -> dict[str, set[str]]:
    return {dist: set(optional_dependencies(dist)) for dist in DISTRIBUTIONS}


def listing_files() -> list[pathlib.Path]:
    return sorted(
        [ROOT / "README.md", ROOT / "noxfile.py"]
        + [ROOT / "packages" / d / "README.md" for d in DISTRIBUTIONS]
        + list((ROOT / "docs").rglob("*.md"))
        + list((ROOT / "packages" / "dmuon-integrations" / "src").rglob("*.py"))
    )


def mentions(text: str) -> set[tuple[str, str]]:
    """The (distribution, extra) pairs ``text`` names, either way."""
    found = set(NAMED.findall(text))
    for dist, extras in LISTED.findall(text.replace("\n", " ")):
        found |= {(dist, e) for e in re.findall(r"`\[([\w-]+)\]`", extras)}
    return found


def test_the_patterns_find_both_ways_of_naming_an_extra():
    text = (
        'pip install "dmuon-optim[hf]"; `dmuon-comm[ilp]`. `dmuon-optim`\'s extras `[fsdp]`,\n'
        "`[deepspeed]` and `[lightning]` install; `dmuon-integrations` has the extras `[hf]`"
    )
    assert mentions(text) == {
        ("dmuon-optim", "hf"),
        ("dmuon-comm", "ilp"),
        ("dmuon-optim", "fsdp"),
        ("dmuon-optim", "deepspeed"),
        ("dmuon-optim", "lightning"),
        ("dmuon-integrations", "hf"),
    }


@pytest.mark.parametrize("path", listing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_extra_named_is_declared(path):
    extras = declared()
    unknown = sorted(
        f"{d}[{e}]" for d, e in mentions(path.read_text()) if e not in extras.get(d, set())
    )
    where = path.relative_to(ROOT)
    assert not unknown, f"{where} names extras no pyproject.toml declares: {unknown}"


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_every_declared_extra_is_shown_in_the_readme_and_getting_started(dist):
    readme = (ROOT / "packages" / dist / "README.md").read_text()
    started = mentions((ROOT / "docs" / "getting-started.md").read_text())
    for extra in sorted(declared()[dist]):
        install = f'pip install "{dist}[{extra}]"'
        assert install in readme, f"packages/{dist}/README.md shows no `{install}`"
        assert (dist, extra) in started, f"docs/getting-started.md does not list {dist}[{extra}]"


def test_dmuon_optim_has_every_extra_of_dmuon_integrations():
    # `pip install "dmuon-optim[X]"` brings dmuon-integrations[X], for every X it has
    extras = declared()
    assert extras["dmuon-integrations"] <= extras["dmuon-optim"]
    optim = optional_dependencies("dmuon-optim")
    for extra in extras["dmuon-integrations"]:
        assert optim[extra] == [f"dmuon-integrations[{extra}]>=0.1.0"]
