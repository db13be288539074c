"""No module of a package imports, directly or through others, a module that imports it;
and imports go down the layers only (kernels and comm import neither each other nor the
packages above them, optim imports kernels and comm, integrations optim and comm).

The graph is read from the source with :mod:`ast`, not by importing, and counts
every ``import``: at module level, inside functions (deferred imports are how
cycles hide), and under ``if TYPE_CHECKING:`` (a cycle for the reader and for the
type checker). ``from P import n`` is an edge to the module ``P.n`` when there is
one (a submodule), else to ``P`` itself — so ``from dmuon.optim import DMuon``
inside ``dmuon.optim.engine`` is an edge to ``dmuon.optim``'s ``__init__``. The
implicit import of a module's parent packages is not an edge (every submodule has
it). A strongly connected component of more than one module is a cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "comm", "optim", "integrations")


def modules_of(src: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name → file, for every ``.py`` under the ``src`` folder."""
    out = {}
    for f in sorted(src.rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module → the modules of ``modules`` it imports anywhere in its source."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    deps.add(sub if sub in modules else target)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    modules = modules_of(ROOT / "packages" / f"dmuon-{package}" / "src")
    assert f"dmuon.{package}" in modules  # the scan found the package
    assert cycles(import_graph(modules)) == []


def test_the_check_finds_a_cycle_hidden_in_a_function_or_under_type_checking(tmp_path):
    pkg = tmp_path / "src" / "dmuon" / "toy"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from dmuon.toy.optimizer import Opt\n")
    (pkg / "optimizer.py").write_text("from dmuon.toy.engine.base import Engine\nclass Opt: ...\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "base.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dmuon.toy.optimizer import Opt\n"
        "class Engine: ...\n"
    )
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from dmuon.toy import a\n")
    (pkg / "c.py").write_text("from dmuon.toy import a\n")  # imports into a cycle: not in it
    graph = import_graph(modules_of(tmp_path / "src"))
    assert cycles(graph) == [
        ["dmuon.toy.a", "dmuon.toy.b"],
        ["dmuon.toy.engine.base", "dmuon.toy.optimizer"],
    ]
    (pkg / "engine" / "base.py").write_text("class Engine: ...\n")
    (pkg / "a.py").write_text("")
    assert cycles(import_graph(modules_of(tmp_path / "src"))) == []


#: the dmuon packages each package may import (itself included): its declared dependencies
LAYERS = {
    "kernels": {"kernels"},
    "comm": {"comm"},
    "optim": {"kernels", "comm", "optim"},
    "integrations": {"comm", "optim", "integrations"},
}


def dmuon_imports(src: pathlib.Path) -> dict[str, set[str]]:
    """Each ``dmuon`` package imported anywhere under ``src`` → the files importing it."""
    found: dict[str, set[str]] = {}
    for f in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue  # a relative import stays inside its package
            for name in names:
                parts = name.split(".")
                if parts[0] == "dmuon" and len(parts) > 1:
                    found.setdefault(parts[1], set()).add(f.relative_to(src).as_posix())
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_go_down_the_layers(package):
    found = dmuon_imports(ROOT / "packages" / f"dmuon-{package}" / "src")
    assert package in found  # the scan found the package's own imports
    upward = {p: sorted(files) for p, files in found.items() if p not in LAYERS[package]}
    assert upward == {}, f"dmuon.{package} imports packages it may not: {upward}"


def test_the_layer_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "src" / "dmuon" / "comm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from dmuon.comm import x\n")
    (pkg / "x.py").write_text("def f():\n    from dmuon.optim import DMuon\n")
    assert dmuon_imports(tmp_path / "src") == {
        "comm": {"dmuon/comm/__init__.py"},
        "optim": {"dmuon/comm/x.py"},
    }
