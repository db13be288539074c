"""The docstring examples run, every public name has one, and comm never imports kernels."""

import ast
import doctest
import importlib
import inspect
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import dmuon.comm

MODULES = sorted(m.name for m in pkgutil.iter_modules(dmuon.comm.__path__, "dmuon.comm."))
CONSTANTS = {
    "COLLECTIVES",
    "DEFAULT_PACK_BELOW",
    "STRATEGIES",
    "VOTE_METHODS",
    "VOTES_PER_BYTE",
    "__version__",
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0


@pytest.mark.parametrize("name", sorted(set(dmuon.comm.__all__) - CONSTANTS))
def test_every_public_name_has_a_docstring_with_an_example(name):
    doc = inspect.getdoc(getattr(dmuon.comm, name)) or ""
    assert "Examples:" in doc, f"{name} has no Examples section"


def test_comm_never_imports_kernels():
    # Statically: no import of dmuon.kernels anywhere in the package.
    root = pathlib.Path(dmuon.comm.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("dmuon.kernels"), path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("dmuon.kernels") for a in node.names), path.name
    # And at run time, in a fresh interpreter.
    code = (
        "import sys, dmuon.comm, dmuon.comm.testing\n"
        "dmuon.comm.plan_owners([dmuon.comm.MatrixItem('w', (4, 4))], 2, strategy='ilp')\n"
        "assert not [m for m in sys.modules if m.startswith('dmuon.kernels')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
