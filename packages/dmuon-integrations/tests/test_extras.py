"""A framework module imported without its extra names the extra to install."""

from __future__ import annotations

import importlib
import pathlib
import re
import sys

import pytest

from dmuon.integrations.extras import EXTRAS, raise_missing_extra

CASES = [
    ("dmuon.integrations.lightning", "lightning", "lightning"),
    ("dmuon.integrations.hf.trainer", "transformers", "hf"),
    ("dmuon.integrations.torchtitan", "torchtitan", "torchtitan"),
]


@pytest.mark.parametrize(("module", "dependency", "extra"), CASES)
def test_missing_framework_names_its_extra(module, dependency, extra, monkeypatch):
    # the framework unimportable (None in sys.modules, its submodules an earlier test
    # imported forgotten), whether installed here or not, and the dmuon module (with its
    # submodules) imported afresh
    monkeypatch.setitem(sys.modules, dependency, None)
    for name in [n for n in sys.modules if n.startswith(dependency + ".")]:
        monkeypatch.delitem(sys.modules, name)
    for name in [n for n in sys.modules if n == module or n.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module(module)
    message = str(err.value)
    assert f'pip install "dmuon-integrations[{extra}]"' in message, message
    assert f"{module} needs {dependency}" in message, message
    assert (err.value.name or "").split(".")[0] == dependency
    assert dependency in EXTRAS[extra]


def test_other_missing_modules_are_not_translated():
    # a module no extra brings: the original error, so a real bug is not disguised
    err = ModuleNotFoundError("No module named 'yaml'", name="yaml")
    assert raise_missing_extra(err, "dmuon.integrations.lightning", "lightning") is None
    # nor another extra's module: triton comes with [torchtitan], not with [lightning]
    err = ModuleNotFoundError("No module named 'triton'", name="triton")
    assert raise_missing_extra(err, "dmuon.integrations.lightning", "lightning") is None


def test_extras_are_the_distributions():
    # EXTRAS is the package metadata's optional dependencies, by top-level module (read
    # from pyproject.toml's lines `name = ["spec", ...]`: tomllib is Python 3.11+)
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    declared = {
        extra: tuple(re.split(r"[<>=!~\[; ]", spec)[0] for spec in re.findall(r'"([^"]+)"', specs))
        for extra, specs in re.findall(r"^(\w+) = \[(.*)\]$", section, re.M)
    }
    assert declared == EXTRAS
