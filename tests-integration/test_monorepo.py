"""The four distributions install side by side into one `dmuon` namespace, and the
repository's promises about commands hold."""

import importlib
import importlib.metadata
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "comm", "optim", "integrations")


@pytest.mark.parametrize("name", PACKAGES)
def test_each_distribution_provides_its_module_with_its_own_version(name):
    module = importlib.import_module(f"dmuon.{name}")
    assert module.__version__ == importlib.metadata.version(f"dmuon-{name}")


def test_dmuon_is_a_namespace_package_spread_over_the_distributions():
    import dmuon

    assert getattr(dmuon, "__file__", None) is None  # PEP 420: no dmuon/__init__.py
    for dist in PACKAGES:
        files = importlib.metadata.files(f"dmuon-{dist}") or []
        assert not any(str(f).replace("\\", "/") == "dmuon/__init__.py" for f in files)


@pytest.mark.parametrize("name", PACKAGES)
def test_each_distribution_is_typed(name):
    """PEP 561: a ``py.typed`` marker in each installed package (``dmuon`` itself is a
    namespace package, so each subpackage carries its own), and the classifier."""
    files = {str(f).replace("\\", "/") for f in importlib.metadata.files(f"dmuon-{name}") or []}
    if any(f.startswith("dmuon/") for f in files):  # a wheel's install lists its files
        assert f"dmuon/{name}/py.typed" in files
    else:  # an editable install (pip install -e) lists a .pth: the marker beside the source
        module = importlib.import_module(f"dmuon.{name}")
        assert (pathlib.Path(module.__file__).parent / "py.typed").is_file()
    classifiers = importlib.metadata.metadata(f"dmuon-{name}").get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers


def test_declared_dependencies_follow_the_layering():
    def requires(dist):
        reqs = importlib.metadata.requires(dist) or []
        return {re.split(r"[ ;<>=\[]", r)[0] for r in reqs if "extra ==" not in r}

    assert "dmuon-comm" not in requires("dmuon-kernels")
    assert "dmuon-kernels" not in requires("dmuon-comm")
    assert {"dmuon-kernels", "dmuon-comm"} <= requires("dmuon-optim")
    # integrations imports dmuon.comm itself: declared, not left to dmuon-optim
    assert {"dmuon-optim", "dmuon-comm"} <= requires("dmuon-integrations")
    extras = importlib.metadata.metadata("dmuon-optim").get_all("Provides-Extra")
    assert {"fsdp", "deepspeed", "hf", "lightning", "torchtitan"} <= set(extras)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln.split("#")[0].strip() for ln in quickstart.strip().splitlines()]
    assert len(lines) == 2, "the Quickstart is exactly two command lines"
    test_command = lines[1]
    ci = (ROOT / ".ci" / "run").read_text()
    for part in test_command.split("&&"):
        assert part.strip() in ci, f"{part.strip()!r} is not what .ci/run runs"
