"""Every ``Example:`` of dmuon.integrations runs, and the layering holds: integrations
use dmuon.optim and torch's public APIs, never the reverse."""

import ast
import doctest
import importlib
import pathlib
import pkgutil

import pytest

import dmuon.integrations
import dmuon.optim

MODULES = sorted(
    m.name
    for m in pkgutil.iter_modules(dmuon.integrations.__path__, "dmuon.integrations.")
    if not m.ispkg
)
# Subpackages (dmuon.integrations.hf, ...) and their modules, found on disk: importing a
# subpackage to walk it would need its optional dependency at collection time.
_ROOT = pathlib.Path(dmuon.integrations.__file__).parent
MODULES += sorted(
    "dmuon.integrations." + ".".join(path.relative_to(_ROOT).with_suffix("").parts[:-1])
    if path.name == "__init__.py"
    else "dmuon.integrations." + ".".join(path.relative_to(_ROOT).with_suffix("").parts)
    for path in _ROOT.glob("*/**/*.py")
)
# Optional dependencies of the extras ([hf], [deepspeed], [lightning], [torchtitan]); the
# torchtitan recipes also need its trainer's (datasets, tensorboard, ...), not in the extra.
OPTIONAL = {
    "transformers",
    "accelerate",
    "deepspeed",
    "lightning",
    "torchtitan",
    "torchdata",
    "tensorboard",
    "datasets",
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs the optional dependency {e.name!r} (an extra)")
        raise
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    assert doctest.testmod(module, optionflags=flags, verbose=False).failed == 0


def _imports(root: pathlib.Path) -> set[str]:
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found.add(node.module or "")
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
    return found


def test_optim_never_imports_integrations():
    assert not [
        m for m in _imports(pathlib.Path(dmuon.optim.__file__).parent) if "integrations" in m
    ]


def test_integrations_touch_no_private_torch_module():
    private = [
        m
        for m in _imports(pathlib.Path(dmuon.integrations.__file__).parent)
        if m.startswith("torch") and any(part.startswith("_") for part in m.split("."))
    ]
    assert private == []
