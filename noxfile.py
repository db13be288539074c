"""Development and CI sessions for the DMuon monorepo.

    nox -s tests-kernels      one package's tests, in a fresh venv holding only that
                              package and its declared dependencies (also -comm, -optim,
                              -integrations)
    nox -s integration        the cross-package tests in tests-integration/
    nox -s docs               mkdocs build --strict
    nox -s lint               ruff + mypy
    nox -s build              wheels + sdists of all four into dist/, twine check, and
                              each wheel installed alone in a fresh venv and imported
    nox -s demo               the main job (see README)
    nox -s bench              the benchmarks, results under benchmarks/results/
    nox -t ci                 everything CI runs (the README's test command)

Every install is constrained by constraints.txt, which pins torch==2.13.0: an
unpinned torch pulls a multi-GB CUDA build.
"""

from __future__ import annotations

import pathlib
import shutil

import nox

ROOT = pathlib.Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
PACKAGES = ("kernels", "comm", "optim", "integrations")
# What each distribution needs from the monorepo (the order pip must see them in).
LOCAL_DEPS = {
    "kernels": ("kernels",),
    "comm": ("comm",),
    "optim": ("kernels", "comm", "optim"),
    "integrations": ("kernels", "comm", "optim", "integrations"),
}
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")

nox.options.sessions = ["lint", *(f"tests-{p}" for p in PACKAGES), "integration", "docs", "build"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True


def pkg_dir(name: str) -> str:
    return str(ROOT / "packages" / f"dmuon-{name}")


def install_local(session: nox.Session, names, extras: dict[str, str] | None = None) -> None:
    extras = extras or {}
    specs = [pkg_dir(n) + (f"[{extras[n]}]" if n in extras else "") for n in names]
    session.install(*CONSTRAINTS, *specs)


def _package_tests(session: nox.Session, package: str) -> None:
    """One package's tests, installed (not editable) with only its declared dependencies."""
    # comm's ILP solver; kernels' Triton kernels (run under TRITON_INTERPRET=1 in the tests)
    extras = {"comm": {"comm": "ilp"}, "kernels": {"kernels": "triton"}}.get(package)
    install_local(session, LOCAL_DEPS[package], extras)
    session.install(*CONSTRAINTS, *TEST_TOOLS)
    # Run from the tests folder so `dmuon` resolves to the installed wheel, not src/.
    session.chdir(pathlib.Path(pkg_dir(package)) / "tests")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", ".", *session.posargs)


def _make_tests_session(package: str) -> None:
    def run(session: nox.Session) -> None:
        _package_tests(session, package)

    run.__doc__ = f"dmuon-{package}'s tests, alone in a fresh venv with its declared dependencies."
    nox.session(name=f"tests-{package}", tags=["ci", "tests"])(run)


for _package in PACKAGES:
    _make_tests_session(_package)


@nox.session(tags=["ci"])
def integration(session: nox.Session) -> None:
    """Tests that combine packages (and real training clients) from tests-integration/."""
    install_local(session, PACKAGES)
    # matplotlib and rich: test_train_harness runs benchmarks/train.py end to end.
    session.install(*CONSTRAINTS, *TEST_TOOLS, "matplotlib>=3.8", "rich>=13")
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests-integration",
        *session.posargs,
    )


@nox.session(tags=["ci"])
def docs(session: nox.Session) -> None:
    """Build the documentation site with --strict (broken links and API refs fail)."""
    session.install(
        *CONSTRAINTS, "mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"
    )
    install_local(session, PACKAGES)
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"))


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and mypy over the sources."""
    session.install(*CONSTRAINTS, "ruff>=0.6", "mypy>=1.11")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    install_local(session, PACKAGES)
    session.run("mypy", *(f"packages/dmuon-{p}/src/dmuon" for p in PACKAGES))


@nox.session(tags=["ci"])
def build(session: nox.Session) -> None:
    """Wheels and sdists of all four into dist/; twine check; each wheel alone in a fresh venv."""
    session.install(*CONSTRAINTS, "build>=1.2", "twine>=5")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for p in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), pkg_dir(p))
    session.run("twine", "check", "--strict", *map(str, sorted(dist.iterdir())))
    # Each wheel in a venv of its own with only its dependencies: the sibling wheels
    # are offered through --find-links but pip installs only what is declared.
    for p in PACKAGES:
        venv = pathlib.Path(session.create_tmp()) / f"alone-{p}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("python", "-m", "venv", str(venv))
        py = str(venv / "bin" / "python")
        (wheel,) = dist.glob(f"dmuon_{p}-*.whl")
        session.run(py, "-m", "pip", "install", "-q", *CONSTRAINTS, "torch", external=True)
        # --no-index: the dmuon dependencies can only come from the wheels just built.
        session.run(
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(dist),
            str(wheel),
            external=True,
        )
        session.run(py, "-c", _import_check(p), external=True)


def _import_check(package: str) -> str:
    """Import the public API and fail if a sibling the package does not declare got in."""
    allowed = {f"dmuon.{n}" for n in LOCAL_DEPS[package]}
    return (
        "import importlib, importlib.util, sys\n"
        f"mod = importlib.import_module('dmuon.{package}')\n"
        "missing = [n for n in getattr(mod, '__all__', []) if not hasattr(mod, n)]\n"
        "assert not missing, missing\n"
        f"allowed = {sorted(allowed)!r}\n"
        f"for other in {[f'dmuon.{n}' for n in PACKAGES]!r}:\n"
        "    present = importlib.util.find_spec(other) is not None\n"
        "    assert present == (other in allowed), (other, present)\n"
        f"print('dmuon.{package}', mod.__version__, 'imports alone')\n"
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job."""
    install_local(session, PACKAGES)
    session.install(*CONSTRAINTS, "matplotlib>=3.8", "rich>=13")
    session.run("python", "benchmarks/kernels.py", "--quick", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark at full size; JSON + PNG under benchmarks/results/."""
    install_local(session, PACKAGES)
    session.install(*CONSTRAINTS, "matplotlib>=3.8", "rich>=13")
    session.run("python", "benchmarks/kernels.py", *session.posargs)
    session.run("python", "benchmarks/comm.py")
    _copy_figures_to_docs()


def _copy_figures_to_docs() -> None:
    target = ROOT / "docs" / "assets" / "benchmarks"
    target.mkdir(parents=True, exist_ok=True)
    for png in (ROOT / "benchmarks" / "results").glob("*.png"):
        shutil.copy2(png, target / png.name)
