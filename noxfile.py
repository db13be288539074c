"""Development and CI sessions for the DMuon monorepo.

    nox -s tests-kernels      one package's tests, in a fresh venv holding only that
                              package and its declared dependencies (also -comm, -optim,
                              -integrations)
    nox -s integration        the cross-package tests in tests-integration/
    nox -s docs               mkdocs build --strict, then the site in headless Chromium
                              (Debian's chromium; installed by the session as root)
    nox -s lint               ruff + mypy
    nox -s build              wheels + sdists of all four into dist/, twine check, each
                              wheel alone and each extra in a fresh venv, public API
                              imported; `-- --release DIST...` adds the release checks
                              (docs/development/releasing.md)
    nox -s compat             the package suites, a distributed subset of the integration
                              tests and the GPU command's dry run on the oldest supported
                              torch (2.11) and triton (3.6), on Python 3.12 where present
    nox -s compat-newest      the same on the newest torch on the index (by hand, before a
                              release: docs/development/index.md)
    nox -s demo               the main job (see README)
    nox -s bench              the benchmarks, results under benchmarks/results/
    nox -t ci                 everything CI runs (the README's test command)

Every install is constrained by constraints.txt, which pins torch==2.13.0: an
unpinned torch pulls a multi-GB CUDA build.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import os
import pathlib
import shutil

import nox
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).parent
# --no-compile: pip byte-compiles every module of torch on install (a sixth of each
# session's install time); Python compiles what a test imports on its own, once, and
# caches it in __pycache__ — unless PYTHONDONTWRITEBYTECODE is set (some machines set
# it globally, CI's among them): then every interpreter a test starts (torchrun, a
# spawned rank, a CLI under test) compiled torch again, `import torch` 4.5 s instead of
# 1.9 s. The sessions drop the variable so the first import writes the cache.
CONSTRAINTS = ("--no-compile", "-c", str(ROOT / "constraints.txt"))
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
PACKAGES = ("kernels", "comm", "optim", "integrations")
# What each distribution needs from the monorepo (the order pip must see them in).
LOCAL_DEPS = {
    "kernels": ("kernels",),
    "comm": ("comm",),
    "optim": ("kernels", "comm", "optim"),
    "integrations": ("kernels", "comm", "optim", "integrations"),
}
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "pytest-xdist>=3.5")
# Two pytest workers, a test file each at a time: CI has two cores, and most tests run
# in one process (a file's module fixtures are built once, on its worker). Distributed
# tests start their ranks as before; `nox -s <session> -- -n 0` runs serially.
WORKERS = ("-n", "2", "--dist", "loadfile")
# One compute thread per process: with two workers each running torch's default of one
# OpenMP thread per core, the threads of one worker spin while the other's run (a 0.4 s
# test took 33 s, the optim suite 163 s instead of 106 s). Ranks and subprocesses inherit it.
# Bytecode is written (PYTHONDONTWRITEBYTECODE empty: unset for Python), although packages
# install with --no-compile: each module is compiled at its first import and read back by
# every later process. A machine that sets PYTHONDONTWRITEBYTECODE=1 otherwise compiles
# torch, lightning and transformers again in every subprocess a test starts
# (test_lightning.py: 149 s of CPU without the cache, 64 s with it).
PYTEST_ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": ""}
# The [torchtitan] extra pulls torchtitan's trainer dependencies; CI installs the package
# alone and what `torchtitan.components.optimizer` and `torchtitan.models` import.
TORCHTITAN_NO_DEPS = ("torchtitan==0.3.0", "spmd_types==0.2.3")
# triton: torchtitan.models imports its MoE kernels' module at import time.
TORCHTITAN_IMPORT_DEPS = ("tyro>=1.0.17", "triton")

nox.options.sessions = [
    "lint",
    *(f"tests-{p}" for p in PACKAGES),
    "integration",
    "compat",
    "docs",
    "build",
]
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
    # comm's ILP solver; kernels' Triton kernels (run under TRITON_INTERPRET=1 in the tests);
    # optim's planner tables and plots (dmuon-plan --plot)
    extras = {
        "comm": {"comm": "ilp"},
        "kernels": {"kernels": "triton"},
        "optim": {"optim": "plan"},
    }.get(package)
    install_local(session, LOCAL_DEPS[package], extras)
    session.install(*CONSTRAINTS, *TEST_TOOLS)
    # Run from the tests folder so `dmuon` resolves to the installed wheel, not src/.
    session.chdir(pathlib.Path(pkg_dir(package)) / "tests")
    # Triton's ahead-of-time compiles for sm80/sm90 (a minute on two cores) run once in CI,
    # in `compat`, on the triton release of the GPU image; every other kernels test runs here.
    deselect = ("-m", "not aot_compile") if package == "kernels" else ()
    pytest = ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *WORKERS, *deselect)
    session.run(*pytest, ".", *session.posargs, env=PYTEST_ENV)


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
    # [hf]: transformers and accelerate for test_hf_trainer; [deepspeed,lightning]:
    # test_deepspeed.py and test_lightning.py (real clients, installed through the extras).
    install_local(session, PACKAGES, {"integrations": "hf,deepspeed,lightning"})
    # torchtitan for test_torchtitan.py, without its trainer's dependencies (datasets,
    # wandb, tensorboard, ...: hundreds of MB): its optimizer container and models import
    # with spmd_types and tyro alone (checked with torchtitan 0.3.0, torch 2.13).
    session.install(*CONSTRAINTS, "--no-deps", *TORCHTITAN_NO_DEPS)
    session.install(*CONSTRAINTS, *TORCHTITAN_IMPORT_DEPS)
    # matplotlib and rich: test_train_harness runs benchmarks/train.py end to end.
    session.install(*CONSTRAINTS, *TEST_TOOLS, "matplotlib>=3.8", "rich>=13")
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *WORKERS,
        # the slowest tests in CI's log, where the suite's time goes (CI has 2 cores)
        "--durations=40",
        "tests-integration",
        *session.posargs,
        env=PYTEST_ENV,
    )


# --- torch range ---------------------------------------------------------------------------
# The oldest torch and triton the packages declare (pyproject lower bounds) and the newest
# torch on the index. The GPU machine this project is lent runs Python 3.12, torch 2.11 and
# triton 3.6: `compat` is that image's software on a CPU.
COMPAT_OLDEST = ("torch==2.11.0", "triton==3.6.0")
# The integration tests that run real gloo process groups through every execution mode,
# FSDP2, HSDP, checkpoints and timeouts (the rest need the clients' extras or are static).
COMPAT_INTEGRATION = (
    "test_modes_equal_single.py",
    "test_modes_api.py",
    "test_sign_mode.py",
    "test_hsdp.py",
    "test_zero3.py",
    "test_checkpoint_reshard.py",
    "test_clip_and_accumulation.py",
    "test_hang_freedom.py",
    "test_timeouts.py",
    "test_comm_cost_matches_kernels.py",
)


def _interpreter(version: str) -> str | None:
    """An interpreter of Python ``version`` on this machine (PATH, else pyenv), or None."""
    import subprocess

    def runs(exe: str) -> bool:
        try:
            done = subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    if runs(f"python{version}"):
        return f"python{version}"
    if shutil.which("pyenv"):
        listed = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True)
        for name in reversed(listed.stdout.split()):
            if name.startswith(version + "."):
                prefix = subprocess.run(["pyenv", "prefix", name], capture_output=True, text=True)
                exe = pathlib.Path(prefix.stdout.strip()) / "bin" / f"python{version}"
                if runs(str(exe)):
                    return str(exe)
    return None


COMPAT_PYTHON = _interpreter("3.12")


def _compat_constraints(session: nox.Session, pins: tuple[str, ...]) -> tuple[str, ...]:
    """constraints.txt with torch and triton replaced by ``pins`` (none: left to torch)."""
    replaced = {canonicalize_name(p.split("=")[0]) for p in ("torch==", "triton==")}
    kept = [
        line
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if canonicalize_name(line.split("=")[0].strip() or "-") not in replaced
    ]
    path = pathlib.Path(session.create_tmp()) / "compat-constraints.txt"
    path.write_text("\n".join([*kept, *pins]) + "\n")
    return ("--no-compile", "-c", str(path))


def _compat(session: nox.Session, pins: tuple[str, ...]) -> None:
    constraints = _compat_constraints(session, pins)
    # A machine's global pip configuration may cap torch below the newest release: the
    # newest run replaces it with no constraint (the session's own file still applies).
    env = {} if pins else {"PIP_CONSTRAINT": os.devnull}
    specs = [pkg_dir("kernels") + "[triton]", pkg_dir("comm") + "[ilp]"]
    specs += [pkg_dir("optim"), pkg_dir("integrations")]
    session.install(*constraints, *specs, *TEST_TOOLS, "matplotlib>=3.8", "rich>=13", env=env)
    session.run(
        "python",
        "-c",
        "import sys, torch, triton; print('compat: Python', sys.version.split()[0], "
        "'torch', torch.__version__, 'triton', triton.__version__)",
    )
    # -rs: every skip prints its reason, so no test is skipped on one torch silently.
    pytest = ("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *WORKERS)
    for package in ("kernels", "comm", "optim", "integrations"):
        session.chdir(pathlib.Path(pkg_dir(package)) / "tests")  # the installed package
        session.run(*pytest, ".", *session.posargs, env=PYTEST_ENV)
    session.chdir(ROOT)
    session.run(*pytest, *(f"tests-integration/{t}" for t in COMPAT_INTEGRATION), env=PYTEST_ENV)
    # The GPU command end to end on the CPU: an import or API error shows here first.
    out = pathlib.Path(session.create_tmp()) / "gpu-run"
    shutil.rmtree(out, ignore_errors=True)
    session.run("python", "benchmarks/gpu_run.py", "--dry-run", "--out", str(out))


@nox.session(python=COMPAT_PYTHON, tags=["ci"])
def compat(session: nox.Session) -> None:
    """The oldest supported torch (2.11.0) and triton (3.6.0), on Python 3.12 where present.

    Runs the test suites of the four packages, the integration tests that
    drive real gloo process groups (COMPAT_INTEGRATION), and ``benchmarks/gpu_run.py
    --dry-run``. torch 2.11.0 comes from PyPI as its CUDA build (about 5 GB with the
    CUDA libraries); it runs on the CPU here.
    """
    _compat(session, COMPAT_OLDEST)


@nox.session(name="compat-newest", python=COMPAT_PYTHON)
def compat_newest(session: nox.Session) -> None:
    """What ``compat`` runs, on the newest torch on the index (and the triton it requires).

    Not in CI (another ~5 GB install and the same suites again): run it by hand before a
    release and record the result on docs/development/index.md.
    """
    _compat(session, ())


# Debian's browser and the matching driver (one source package, so versions always agree).
CHROMIUM = pathlib.Path("/usr/bin/chromium")
CHROMEDRIVER = pathlib.Path("/usr/bin/chromedriver")


@nox.session(tags=["ci"])
def docs(session: nox.Session) -> None:
    """mkdocs build --strict, then the site served on localhost in headless Chromium.

    The browser test (docs/tests/) needs Debian's chromium and chromium-driver; run as
    root where they are missing, this session installs them with apt-get. Elsewhere the
    test skips with a message, except under CI (CI set), where it must run.
    """
    session.install(
        *CONSTRAINTS,
        "mkdocs>=1.6",
        "mkdocs-material>=9.5",
        "mkdocstrings[python]>=0.26",
        "ruff>=0.6",  # mkdocstrings formats the signatures with it
        *TEST_TOOLS[:2],
        "pytest-xdist>=3.5",
        "selenium>=4.20",
    )
    # No install of the packages: mkdocstrings reads their sources (mkdocs.yml `paths`).
    site = ROOT / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site))
    _ensure_chromium(session)
    env = {"DMUON_SITE_DIR": str(site), "SE_OFFLINE": "true"}  # Selenium Manager: no downloads
    if os.environ.get("CI"):
        env["DMUON_SITE_TEST_REQUIRE_BROWSER"] = "1"
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        # two workers, each with its own browser and server; tests, not files, are spread
        *("-n", "2", "--dist", "load"),
        "docs/tests",
        *session.posargs,
        env=env,
    )


def _ensure_chromium(session: nox.Session) -> None:
    if CHROMIUM.is_file() and CHROMEDRIVER.is_file():
        return
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        session.warn(
            f"{CHROMIUM} or {CHROMEDRIVER} missing and this is not root with apt-get: "
            "install Debian's chromium and chromium-driver, or the browser test skips"
        )
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, env=env)
    session.run(
        "apt-get",
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        "chromium",
        "chromium-driver",
        external=True,
        env=env,
    )


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and mypy over the sources."""
    session.install(*CONSTRAINTS, "ruff>=0.6", "mypy>=1.11")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    install_local(session, PACKAGES)
    session.run("mypy", *(f"packages/dmuon-{p}/src/dmuon" for p in PACKAGES))


# --- build ---------------------------------------------------------------------------------
# What each extra must make importable, on top of the public API of every dmuon package the
# install brought in. Every extra a built wheel declares is installed in a fresh venv, either
# as a key here or through a key that requires it (dmuon-optim[hf] pulls
# dmuon-integrations[hf]); the session fails on an extra that nothing covers.
# The dmuon modules named here need their extra: installs without it do not import them.
# A dmuon module whose source is not under packages/ yet is reported as "not yet built"
# (never skipped silently); as soon as its source exists it must import from the wheels.
EXTRA_IMPORTS: dict[str, tuple[str, ...]] = {
    "dmuon-kernels[triton]": ("triton", "numpy", "dmuon.kernels.triton"),
    "dmuon-comm[ilp]": ("scipy.optimize",),
    "dmuon-optim[triton]": ("triton", "dmuon.kernels.triton"),
    "dmuon-optim[fsdp]": ("dmuon.integrations", "torch.distributed.fsdp"),
    "dmuon-optim[deepspeed]": ("deepspeed", "dmuon.integrations.deepspeed"),
    "dmuon-optim[hf]": ("transformers", "accelerate", "dmuon.integrations.hf"),
    "dmuon-optim[plan]": ("rich", "matplotlib"),
    "dmuon-optim[lightning]": ("lightning", "dmuon.integrations.lightning"),
    "dmuon-optim[torchtitan]": (
        "torchtitan",
        "dmuon.integrations.torchtitan",
        "dmuon.integrations.torchtitan.recipes",
    ),
}
# The build backend every pyproject.toml names, at the lower bound they state (1.25 failed:
# `license-files` as a list needs 1.26): `python -m build --no-isolation` builds with it and
# checks that it satisfies each package's [build-system] requires (and fails if not).
BUILD_BACKEND = "hatchling==1.26.3"


@nox.session(tags=["ci"])
def build(session: nox.Session) -> None:
    """Wheels + sdists into dist/, twine check, each wheel alone and each extra in a fresh venv.

    Every venv gets the public API of each dmuon package it holds imported (all of
    ``__all__`` and every public submodule) and must hold exactly the dmuon packages
    the wheels' metadata declare, all of them from dist/. To keep the session short,
    the venvs share one read-only base holding only the pinned torch (through a .pth
    file): torch is declared by every package, and installing it costs ~30 s a venv;
    and two venvs are installed and checked at a time.
    """
    releasing = _release_args(session)
    session.install(*CONSTRAINTS, "build>=1.2", "twine>=5", BUILD_BACKEND)
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for p in PACKAGES:
        _check_changelog_names_version(session, p)
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), pkg_dir(p))
    session.run("twine", "check", "--strict", *map(str, sorted(dist.iterdir())))
    meta = {f"dmuon-{p}": _wheel_metadata(session, dist, p) for p in PACKAGES}
    _check_internal_requirements(session, meta)
    if releasing:  # before the slow part: fail fast
        _check_release(session, meta, releasing)

    tmp = pathlib.Path(session.create_tmp()).resolve()
    base = _torch_base(session, tmp / "base-torch")
    pins = tmp / "dmuon-pins.txt"  # dmuon-* at exactly the built versions
    pins.write_text("".join(f"{d}=={m['version']}\n" for d, m in meta.items()))
    gated = sorted({m for mods in EXTRA_IMPORTS.values() for m in mods if m.startswith("dmuon.")})
    planned = [m for m in gated if not _source_exists(m)]
    checker = tmp / "check_installed_api.py"  # runs inside each venv: stdlib only
    checker.write_text(
        f"import json\nimport sys\n\n\n{inspect.getsource(_check_installed_api)}\n\n"
        "_check_installed_api(json.loads(open(sys.argv[1]).read()))\n"
    )

    covered: set[tuple[str, str | None]] = set()
    jobs: list[tuple[dict, bool]] = []
    checks = [(f"dmuon-{p}", None) for p in PACKAGES]
    checks += [_split_extra(spec) for spec in EXTRA_IMPORTS]
    for dist_name, extra in checks:
        declared = meta[dist_name]["extras"]
        if extra is not None and extra not in declared:
            session.error(f"EXTRA_IMPORTS names {dist_name}[{extra}]; it declares {declared}")
        brought = _resolve(meta, dist_name, extra)
        covered |= brought
        packages = sorted({d.removeprefix("dmuon-") for d, _ in brought}, key=PACKAGES.index)
        if extra is None:  # the noxfile's test sessions install by LOCAL_DEPS: keep them equal
            local = sorted(LOCAL_DEPS[dist_name.removeprefix("dmuon-")], key=PACKAGES.index)
            if packages != local:
                session.error(f"{dist_name} declares {packages}, LOCAL_DEPS says {local}")
        label = dist_name + (f"[{extra}]" if extra else "")
        args = {
            "label": label,
            "packages": packages,
            "all_packages": list(PACKAGES),
            "extra_modules": list(EXTRA_IMPORTS.get(label, ())),
            "gated": gated,
            "planned": planned,
        }
        jobs.append((args, extra is None))

    def check(job: tuple[dict, bool]) -> str | None:
        args, alone = job
        try:  # every install is checked, then the failures are listed together
            _install_and_import(session, tmp, base, dist, pins, checker, args, alone)
        except nox.command.CommandFailed as exc:
            return f"{args['label']}: {exc.reason or exc}"
        return None

    # Two venvs at a time (CI's two cores): an install is pip unpacking and one process
    # importing, each mostly on one core. Output of the two interleaves.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failed = [f for f in pool.map(check, jobs) if f is not None]

    if failed:
        session.error("installs that failed their check:\n  " + "\n  ".join(failed))
    wanted = {(d, e) for d, m in meta.items() for e in [None, *m["extras"]]}
    if wanted - covered:
        missing = sorted(f"{d}[{e}]" for d, e in wanted - covered)
        session.error(f"extras never installed by this session: {missing}; add to EXTRA_IMPORTS")
    for m in planned:
        needs = [s for s, mods in EXTRA_IMPORTS.items() if m in mods]
        session.warn(f"not yet built: {m} (planned, checked with {needs} once its source exists)")
    if releasing:
        _print_release_commands(session, meta, releasing)


def _install_and_import(
    session: nox.Session,
    tmp: pathlib.Path,
    base: pathlib.Path,
    dist: pathlib.Path,
    pins: pathlib.Path,
    checker: pathlib.Path,
    args: dict,
    alone: bool,
) -> None:
    """One fresh venv: install args["label"] from dist/, then run the import check in it."""
    label = args["label"]
    venv = tmp / label.replace("[", "-").replace("]", "")
    py = _fresh_venv(session, venv, base)
    report = venv / "pip-report.json"
    install = ["-m", "pip", "install", "-q", "--report", str(report)]
    install += [*CONSTRAINTS, "-c", str(pins), "--find-links", str(dist)]
    if alone:
        # The wheel file itself; its dmuon dependencies at the pinned versions, found in
        # dist/ (the report below refuses one from anywhere else); other declared
        # dependencies (numpy for dmuon-integrations) from the index.
        (wheel,) = dist.glob(f"{label.replace('-', '_')}-*.whl")
        session.run(py, *install, str(wheel), external=True)
    else:
        session.run(py, *install, label, external=True)
    for item in json.loads(report.read_text())["install"]:
        name, url = item["metadata"]["name"], item["download_info"]["url"]
        if name.startswith("dmuon") and not url.startswith(dist.as_uri() + "/"):
            raise nox.command.CommandFailed(f"{name} was installed from {url}, not from dist/")
    (venv / "check-args.json").write_text(json.dumps(args))
    session.run(py, str(checker), str(venv / "check-args.json"), external=True)
    shutil.rmtree(venv)  # passed: keep the disk small (a failed venv stays for a look)


def _release_args(session: nox.Session) -> list[str]:
    """``nox -s build -- --release dmuon-kernels [...]``: the distributions to release."""
    args = list(session.posargs)
    if not args:
        return []
    if args[0] != "--release" or len(args) < 2:
        session.error("usage: nox -s build [-- --release DIST [DIST ...]]")
    wrong = [a for a in args[1:] if a not in {f"dmuon-{p}" for p in PACKAGES}]
    if wrong:
        session.error(f"--release takes distribution names (dmuon-kernels, ...), not {wrong}")
    return args[1:]


def _git(*args: str) -> str:
    import subprocess

    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def _check_release(session: nox.Session, meta: dict, releasing: list[str]) -> None:
    """What docs/development/releasing.md asks before an upload, checked on the built files."""
    import re

    problems = []
    if _git("status", "--porcelain", "--untracked-files=no"):
        problems.append("the working tree has uncommitted changes: release from a clean commit")
    head = _git("rev-parse", "HEAD")
    for dist_name in releasing:
        version = meta[dist_name]["version"]
        changelog = (ROOT / "packages" / dist_name / "CHANGELOG.md").read_text()
        if not re.search(
            rf"^## {re.escape(version)} — \d{{4}}-\d{{2}}-\d{{2}}\s*$", changelog, re.M
        ):
            problems.append(f"{dist_name}: CHANGELOG.md needs '## {version} — YYYY-MM-DD'")
        tag = f"{dist_name}-v{version}"
        tagged = _git("rev-list", "-n", "1", tag)
        if tagged and tagged != head:
            problems.append(f"{dist_name}: tag {tag} exists on another commit: bump the version")
        for req in meta[dist_name]["requires"]:
            dep = canonicalize_name(req.name)
            if dep not in meta or dep in releasing or req.marker is not None:
                continue
            released = [
                t.removeprefix(f"{dep}-v") for t in _git("tag", "--list", f"{dep}-v*").split()
            ]
            if not any(req.specifier.contains(v) for v in released):
                problems.append(
                    f"{dist_name} requires {req}, and no tag {dep}-v* satisfies it: "
                    f"release {dep} first (or in the same run)"
                )
    if problems:
        session.error("not releasable:\n  " + "\n  ".join(problems))


def _print_release_commands(session: nox.Session, meta: dict, releasing: list[str]) -> None:
    order = [d for d in (f"dmuon-{p}" for p in PACKAGES) if d in releasing]
    for dist_name in order:
        files = sorted(
            str(f.relative_to(ROOT))
            for f in (ROOT / "dist").glob(
                f"{dist_name.replace('-', '_')}-{meta[dist_name]['version']}*"
            )
        )
        tag = f"{dist_name}-v{meta[dist_name]['version']}"
        session.log(
            f"release {dist_name}: git tag -a {tag} -m '{dist_name} {meta[dist_name]['version']}'"
        )
        session.log(f"release {dist_name}: twine upload {' '.join(files)}")


def _split_extra(spec: str) -> tuple[str, str | None]:
    name, _, rest = spec.partition("[")
    return name, rest.rstrip("]") or None


def _source_exists(module: str) -> bool:
    parts = module.split(".")
    src = ROOT / "packages" / f"dmuon-{parts[1]}" / "src" / pathlib.Path(*parts)
    return src.with_suffix(".py").is_file() or (src / "__init__.py").is_file()


def _check_changelog_names_version(session: nox.Session, package: str) -> None:
    version_file = pathlib.Path(pkg_dir(package)) / "src" / "dmuon" / package / "_version.py"
    version = version_file.read_text().split("=")[1].strip().strip("\"'")
    changelog = (pathlib.Path(pkg_dir(package)) / "CHANGELOG.md").read_text()
    if f"\n## {version} " not in changelog and f"\n## {version}\n" not in changelog:
        session.error(
            f"dmuon-{package} is version {version} but its CHANGELOG.md has no '## {version}' "
            "section (see docs/development/releasing.md)"
        )


def _wheel_metadata(session: nox.Session, dist: pathlib.Path, package: str) -> dict:
    """Version, declared extras and requirements of the built wheel, and a layout check."""
    import email.parser
    import zipfile

    from packaging.requirements import Requirement

    (wheel,) = dist.glob(f"dmuon_{package}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_path,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        msg = email.parser.Parser().parsestr(zf.read(meta_path).decode())
    # PEP 420: the wheel ships dmuon/<package>/ only, never a dmuon/__init__.py.
    stray = [n for n in names if not n.startswith((f"dmuon/{package}/", "dmuon_"))]
    if stray:
        session.error(f"{wheel.name} ships files outside dmuon/{package}/: {stray}")
    return {
        "version": msg["Version"],
        "extras": msg.get_all("Provides-Extra") or [],
        "requires": [Requirement(r) for r in msg.get_all("Requires-Dist") or []],
    }


def _reqs_of(meta: dict, dist_name: str, extra: str | None) -> list:
    """The requirements of dist_name that hold without extras (extra=None) or only with extra."""
    out = []
    for req in meta[dist_name]["requires"]:
        base = req.marker is None or req.marker.evaluate({"extra": ""})
        if (extra is None and base) or (
            extra is not None and not base and req.marker.evaluate({"extra": extra})
        ):
            out.append(req)
    return out


def _resolve(meta: dict, dist_name: str, extra: str | None) -> set[tuple[str, str | None]]:
    """The (distribution, extra) pairs of built wheels that installing dist_name[extra] brings."""
    todo: list[tuple[str, str | None]] = [(dist_name, None)]
    if extra is not None:
        todo.append((dist_name, extra))
    seen: set[tuple[str, str | None]] = set()
    while todo:
        item = todo.pop()
        if item in seen:
            continue
        seen.add(item)
        for req in _reqs_of(meta, *item):
            name = canonicalize_name(req.name)
            if name in meta:
                todo += [(name, None), *((name, e) for e in req.extras)]
    return seen


def _check_internal_requirements(session: nox.Session, meta: dict) -> None:
    """Every dmuon-* requirement is satisfied by the sibling version built next to it."""
    for dist_name, m in meta.items():
        for req in m["requires"]:
            name = canonicalize_name(req.name)
            if name in meta and not req.specifier.contains(meta[name]["version"]):
                session.error(
                    f"{dist_name} requires {req}, but dist/ holds {name} "
                    f"{meta[name]['version']}: bump the range or release in order "
                    "(docs/development/releasing.md)"
                )


def _torch_base(session: nox.Session, venv: pathlib.Path) -> pathlib.Path:
    """A venv with pip and the pinned torch only; returns its site-packages."""
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    session.run(py, "-m", "pip", "install", "-q", *CONSTRAINTS, "torch", external=True)
    return _site_packages(venv)


def _site_packages(venv: pathlib.Path) -> pathlib.Path:
    (site,) = venv.glob("lib/python3*/site-packages")
    return site


def _fresh_venv(session: nox.Session, venv: pathlib.Path, base: pathlib.Path) -> str:
    """An empty venv that sees the torch base (and its pip) after its own site-packages."""
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", "--without-pip", str(venv))
    (_site_packages(venv) / "_dmuon_torch_base.pth").write_text(f"{base}\n")
    return str(venv / "bin" / "python")


def _check_installed_api(args: dict) -> None:
    """Runs inside each fresh venv (written to a script file by build()): stdlib only.

    Imports every installed dmuon package, checks its ``__all__`` resolves and its version
    is the distribution's, imports each public submodule (not the ones needing an extra
    this venv did not install), then the modules the extra promises.
    """
    import importlib
    import importlib.metadata
    import importlib.util
    import pkgutil
    import sys

    problems: list[str] = []
    imported: list[str] = []
    attempted: set[str] = set()
    not_built: list[str] = []

    def load(name: str):  # a module, or None when the import failed
        attempted.add(name)
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # report every failure, not only the first
            hint = ""
            if isinstance(exc, ModuleNotFoundError) and not (exc.name or "").startswith("dmuon"):
                hint = " (an optional dependency? list the module in EXTRA_IMPORTS)"
            problems.append(f"import {name}: {type(exc).__name__}: {exc}{hint}")
            return None
        imported.append(name)
        names = getattr(module, "__all__", None) if name.startswith("dmuon.") else ()
        if names is None and name.count(".") == 1:
            problems.append(f"{name} has no __all__ (its public API)")
        missing = [n for n in names or () if not hasattr(module, n)]
        if missing:
            problems.append(f"{name}.__all__ names attributes it lacks: {missing}")
        return module

    def walk(module) -> None:
        for info in pkgutil.iter_modules(module.__path__, module.__name__ + "."):
            if info.name.rsplit(".", 1)[1].startswith("_"):
                continue
            if info.name in args["gated"] and info.name not in args["extra_modules"]:
                continue  # needs an extra this venv does not have; checked in that one
            sub = load(info.name)
            if sub is not None and info.ispkg:
                walk(sub)

    for pkg in args["all_packages"]:
        dist, expected = f"dmuon-{pkg}", pkg in args["packages"]
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        found = importlib.util.find_spec(f"dmuon.{pkg}") is not None
        if (version is not None, found) != (expected, expected):
            state = "installed" if found else "absent"
            problems.append(f"{dist} is {state}; the metadata says it should be the opposite")
        if expected and found:
            module = load(f"dmuon.{pkg}")
            if module is not None:
                if module.__version__ != version:
                    problems.append(f"dmuon.{pkg}.__version__ {module.__version__} != {version}")
                walk(module)
    for name in args["extra_modules"]:
        if name in args["planned"]:
            not_built.append(name)
        elif name not in attempted:
            load(name)

    counts = {p: sum(m.startswith(f"dmuon.{p}") for m in imported) for p in args["packages"]}
    others = [m for m in imported if not m.startswith("dmuon.")]
    print(
        f"{args['label']}: imported {len(imported)} modules:",
        ", ".join(f"dmuon.{p} and {n - 1} public submodules" for p, n in counts.items() if n),
        f"+ {', '.join(others)}" if others else "",
    )
    for name in not_built:
        print(f"{args['label']}: not yet built: {name} (planned; no source under packages/)")
    for problem in problems:
        print(f"{args['label']}: FAILED {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job: a byte-level GPT trained on 4 ranks with DMuon and AdamW.

    4 gloo processes on a CPU (or 4 GPUs with NCCL where CUDA has them), owner mode +
    FSDP2 against AdamW + FSDP2; prints the loss and step-time table, writes JSON + PNG
    under benchmarks/results/. Arguments after ``--`` go to benchmarks/demo.py.
    """
    install_local(session, PACKAGES)
    session.install(*CONSTRAINTS, "matplotlib>=3.8", "rich>=13")
    session.run("python", "benchmarks/demo.py", *session.posargs, env=PYTEST_ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark at full size; JSON + PNG under benchmarks/results/."""
    install_local(session, PACKAGES)
    session.install(*CONSTRAINTS, "matplotlib>=3.8", "rich>=13")
    session.run("python", "benchmarks/kernels.py", *session.posargs)
    session.run("python", "benchmarks/comm.py")
    session.run("python", "benchmarks/step.py", "--world", "2")
    _copy_figures_to_docs()


def _copy_figures_to_docs() -> None:
    target = ROOT / "docs" / "assets" / "benchmarks"
    target.mkdir(parents=True, exist_ok=True)
    for png in (ROOT / "benchmarks" / "results").glob("*.png"):
        shutil.copy2(png, target / png.name)
