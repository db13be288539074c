"""Every public name of the four packages is documented: classes and functions with a
docstring that has an ``Example:`` section, constants with a docstring of their own.

Public names are each package's ``__all__`` plus every object an API page renders
(``::: dmuon.comm.testing.run_on_ranks``, ``::: dmuon.kernels.triton.syrk``). A module
that needs an optional dependency this environment lacks is reported as skipped, with the
dependency it needs.

Names that lack an example today are listed in WITHOUT_EXAMPLE and run as strict xfails:
the list is the to-do of the package that owns them, and a fixed name fails until it is
taken off the list, so the list cannot go stale.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "comm", "optim", "integrations")
EXAMPLE = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)

# Known gaps, by owner (fix the docstring in that package, then delete the line here).
WITHOUT_EXAMPLE: set[str] = set()
# Constants without a docstring of their own (a string literal right after the assignment,
# which is what mkdocstrings renders; a comment above is not seen by readers of the site).
WITHOUT_DOCSTRING: set[str] = set()


def _documented_on_api_pages() -> list[str]:
    """What the API pages render below the package level (``::: dmuon.x.Name``)."""
    found = []
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for target in re.findall(r"^::: (dmuon\.[\w.]+)", page.read_text(), re.MULTILINE):
            if target.count(".") >= 2:
                found.append(target)
    return found


def _public_names() -> list[object]:
    params: list[object] = []
    seen: set[str] = set()

    def add(module: str, name: str) -> None:
        if f"{module}.{name}" not in seen:
            seen.add(f"{module}.{name}")
            params.append((module, name))

    for pkg in PACKAGES:
        for name in importlib.import_module(f"dmuon.{pkg}").__all__:
            add(f"dmuon.{pkg}", name)
    for target in _documented_on_api_pages():
        module, _, name = target.rpartition(".")
        try:
            importlib.import_module(module)
        except ImportError as exc:  # an optional dependency missing here (or a bug: re-raised)
            if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("dmuon"):
                raise
            if module not in seen:  # one visible skip per module that cannot be imported here
                seen.add(module)
                reason = f"{module} cannot be imported here: {exc}"
                params.append(pytest.param(module, "*", marks=pytest.mark.skip(reason=reason)))
            continue
        # A module directive (``::: dmuon.comm.testing``) documents a module, not a name. A
        # name that is also a submodule's name (dmuon.kernels.orthogonalize) is the name.
        # A submodule the package does not import itself (dmuon.integrations.torchtitan
        # .recipes, which needs extra dependencies) is found by its spec.
        parent = importlib.import_module(module)
        obj = getattr(parent, name, None)
        if inspect.ismodule(obj):
            continue
        if obj is None and hasattr(parent, "__path__") and importlib.util.find_spec(target):
            continue
        add(module, name)
    return [
        pytest.param(*p, marks=pytest.mark.xfail(strict=True, reason="known gap"))
        if type(p) is tuple and f"{p[0]}.{p[1]}" in WITHOUT_EXAMPLE | WITHOUT_DOCSTRING
        else p
        for p in params
    ]


def _attribute_docstring(module_name: str, name: str) -> str | None:
    """The string literal right after ``name = ...`` in the module that defines it
    (how mkdocstrings documents constants), following ``from x import name``."""
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None, module_name
    package = module_name if spec.submodule_search_locations else module_name.rpartition(".")[0]
    body = ast.parse(pathlib.Path(spec.origin).read_text()).body
    for i, node in enumerate(body):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                after = body[i + 1] if i + 1 < len(body) else None
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    return after.value.value if isinstance(after.value.value, str) else None
                return None
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = importlib.util.resolve_name(
                        "." * node.level + (node.module or ""), package
                    )
                    return _attribute_docstring(source, alias.name)
    return None


@pytest.mark.parametrize(("module", "name"), _public_names())
def test_public_name_is_documented(module, name):
    if name.startswith("__"):  # __version__ and friends: standard, documented by convention
        return
    obj = getattr(importlib.import_module(module), name)
    if inspect.ismodule(obj):  # a re-exported submodule (dmuon.integrations.fsdp)
        assert (obj.__doc__ or "").strip(), f"{module}.{name} (a module) has no docstring"
        return
    if inspect.isclass(obj) or inspect.isroutine(obj):
        doc = obj.__doc__ or ""
        assert doc.strip(), f"{module}.{name} has no docstring"
        assert EXAMPLE.search(inspect.cleandoc(doc)), f"{module}.{name} has no Example: section"
    else:
        doc = _attribute_docstring(module, name)
        assert doc and doc.strip(), f"{module}.{name} (a constant) has no docstring after it"


def test_known_gaps_are_public_names():
    """The gap lists name only public names, so a rename cannot hide a gap."""
    public, unreadable = set(), set()
    for p in _public_names():
        module, name = p.values if hasattr(p, "values") else p
        if name == "*":  # a module this environment cannot import: its names are unknown
            unreadable.add(module)
        public.add(f"{module}.{name}")
    listed = {
        g for g in WITHOUT_EXAMPLE | WITHOUT_DOCSTRING if g.rpartition(".")[0] not in unreadable
    }
    stale = sorted(listed - public)
    assert not stale, f"not public names (renamed or removed?): drop {stale} from the lists"
