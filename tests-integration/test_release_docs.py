"""The release procedure's page tells the truth about what is installed: its compatibility
table lists each distribution's requirements exactly as the installed metadata declares
them, every distribution has its own section, and every changelog has a section for the
installed version (`nox -s build` checks the same on the sources)."""

import importlib.metadata
import pathlib
import re

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "development" / "releasing.md"
DISTRIBUTIONS = ("dmuon-kernels", "dmuon-comm", "dmuon-optim", "dmuon-integrations")


def _table() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].strip("`") in DISTRIBUTIONS:
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def _documented(dist: str) -> tuple[str, str]:
    """The two cells the metadata of `dist` implies, written as the page writes them."""
    base: list[str] = []
    extras: dict[str, list[str]] = {}
    for raw in importlib.metadata.requires(dist) or []:
        req = Requirement(raw)
        text = f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}"
        text += str(req.specifier)
        marker = str(req.marker) if req.marker else ""
        extra = re.search(r"extra == ['\"]([\w-]+)['\"]", marker)
        if extra:
            extras.setdefault(extra.group(1), []).append(text)
        else:
            base.append(text)
    base_cell = ", ".join(f"`{r}`" for r in sorted(base))
    extras_cell = "; ".join(
        f"`[{e}]`: " + ", ".join(f"`{r}`" for r in sorted(reqs))
        for e, reqs in sorted(extras.items())
    )
    return base_cell, extras_cell


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_compatibility_table_matches_the_installed_metadata(dist):
    table = _table()
    assert dist in table, f"{PAGE.name} has no row for {dist}"
    assert table[dist] == _documented(dist), (
        f"{PAGE.name}'s row for {dist} should read: | `{dist}` | {' | '.join(_documented(dist))} |"
    )


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_each_distribution_has_its_release_section(dist):
    text = PAGE.read_text()
    assert f"\n## {dist}\n" in text
    pkg = dist.removeprefix("dmuon-")
    section = " ".join(text.split(f"\n## {dist}\n", 1)[1].split("\n## ", 1)[0].split())
    assert f"src/dmuon/{pkg}/_version.py" in section
    assert f"tag: `{dist}-vX.Y.Z`" in section
    assert f"twine upload dist/{dist.replace('-', '_')}-X.Y.Z*" in section


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_changelog_has_a_section_for_the_installed_version(dist):
    version = importlib.metadata.version(dist)
    changelog = (ROOT / "packages" / dist / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(version)}( |$)", changelog, re.MULTILINE), (
        f"{dist} {version} has no '## {version}' section in its CHANGELOG.md"
    )


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_readme_shows_how_to_install_every_extra(dist):
    # The README is the distribution's description on the package index: what a newcomer
    # reads before installing. dmuon-integrations' said "Status: skeleton ... its public
    # API is not written yet" and named neither [lightning] nor [torchtitan]; dmuon-optim's
    # named none of its extras.
    readme = (ROOT / "packages" / dist / "README.md").read_text()
    extras = importlib.metadata.metadata(dist).get_all("Provides-Extra") or []
    missing = [e for e in extras if f'pip install "{dist}[{e}]"' not in readme]
    assert not missing, f"packages/{dist}/README.md shows no `pip install` of {missing}"
    for stale in ("skeleton", "not written yet", "comes next"):
        assert stale not in readme, f"packages/{dist}/README.md still says {stale!r}"
