"""The one prepared GPU command: every GPU check and benchmark in one call, no network.

The GPU machine this project is sometimes lent has Python 3.12, torch 2.11 and triton
3.6 and cannot reach a package index. This script runs there with the image's
``python3`` and this checkout's sources (``packages/*/src`` on the path, nothing
installed), installs from a folder of wheels carried with the working tree whatever
the image lacks (pytest, hypothesis, rich, matplotlib, ...), then runs, each under its
own time limit:

1. ``benchmarks/gpu_check.py``: the kernel tests compiled on the GPU, the symmetric
   kernels against cuBLAS, whole Newton–Schulz calls against the GEMM rate;
2. ``benchmarks/step.py --single``: the optimizer step of DMuon (every rule) against
   ``torch.optim.Muon`` and AdamW on the GPT-2-small and Llama-1B weight shapes;
3. ``benchmarks/kernels.py``: each ``orthogonalize`` call at the CUDA shapes, standard
   vs Gram, against the dense GEMM rate;
4. ``benchmarks/tp_gram.py``: Newton–Schulz of a tensor-parallel matrix per rank, the
   Gram iteration on the shards against gather + Gram, at 4096×14336 split 2 and 4 ways;
5. ``benchmarks/profile_ns.py --device cuda`` (full mode): where the GPU time of a
   Newton–Schulz call and of the optimizer step at Llama-1B shapes goes, by operator
   group, DMuon against ``torch.optim.Muon``;
6. ``dmuon-plan --calibrate`` on CUDA (full mode): the GPU's device profile for the
   planner (GEMM, Newton–Schulz on Llama-3.1-8B's shapes, AdamW's bandwidth);
7. ``benchmarks/compile_check.py`` (full mode): ``torch.compile`` with inductor after
   ``ddp.dedicate(reshard_after_forward=True)`` and under FSDP2's sharded mode, equal
   to eager and without recompiles after the first step;
8. ``benchmarks/step_overhead.py --device cuda``: the host cost of an optimizer step per
   parameter on tiny matrices, DMuon against AdamW (foreach and fused), where a GPU step
   is bound by the host.

Everything lands in ``--out`` (default ``$OUT``, the folder the GPU tool returns, else
``benchmarks/results/gpu-run``): ``gpu-run.json`` (versions, each step's command,
status, seconds and the tail of its output) and ``gpu-run-results.tar.gz`` holding every
JSON and PNG the steps wrote (the GPU tool returns at most 8 files). Full mode fits in
9.5 minutes, ``--quick`` in 3, so a quick rerun fits in a session's 15 minutes of device time.

    python benchmarks/gpu_run.py --prepare-wheels   # on the CPU machine, with network
    python3 benchmarks/gpu_run.py                    # on the GPU machine (< 9 min)
    python3 benchmarks/gpu_run.py --quick            # < 3 min
    python benchmarks/gpu_run.py --dry-run           # on a CPU: tiny shapes, Triton
                                                     # interpreter; catches import/API errors

The wheels folder (``benchmarks/gpu-wheels/``, ignored by git, < 64 MiB) is made by
``--prepare-wheels`` with ``pip download --only-binary=:all: --python-version 3.12
--platform manylinux_2_28_x86_64``; hand it to the GPU tool's ``carry``. See
docs/development/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(ROOT))
SOURCES = [
    ROOT / "packages" / f"dmuon-{p}" / "src" for p in ("kernels", "comm", "optim", "integrations")
]
WHEELS = ROOT / "benchmarks" / "gpu-wheels"
WHEELS_LIMIT = 60 * 2**20  # the GPU tool carries 64 MiB in all
TAIL = 4000  # characters of each step's output kept in gpu-run.json
BUNDLE = "gpu-run-results.tar.gz"  # every step's JSON and PNG, in one file
# (import name, distribution): what the steps need beyond torch and triton. Missing ones
# come from the wheels folder; matplotlib only draws the PNGs, rich only the tables.
NEEDED = [
    ("pytest", "pytest"),
    ("pytest_timeout", "pytest-timeout"),
    ("hypothesis", "hypothesis"),
    ("numpy", "numpy"),
    ("rich", "rich"),
    ("matplotlib", "matplotlib"),
]
# The GPU image: what --prepare-wheels downloads for.
IMAGE_PYTHON = "3.12"
# pip takes the tags literally: list the older manylinux tags the image's glibc also runs.
IMAGE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def steps(mode: str, out: pathlib.Path) -> list[tuple[str, list[str], float]]:
    """(name, command, time limit in seconds) of each step for ``mode``.

    The limits add up to 560 s (full) and 180 s (quick): under the 8 and 3 minutes the
    GPU tool's budget leaves for one rerun. ``dry-run`` runs the same steps on a CPU at
    tiny sizes.
    """
    py = sys.executable
    b = ROOT / "benchmarks"
    o = ["--out", str(out)]
    tp = [*o, "--no-plot"]
    # the planner calibrates Newton–Schulz on a model's shapes: Llama-3.1-8B's on the GPU,
    # a 2-layer GPT-2 of width 128 in the dry run (the code path, in seconds on a CPU)
    model = str(b / "configs" / "tiny-gpt2.json") if mode == "dry-run" else "llama-3.1-8b"
    plan = [py, "-m", "dmuon.optim.planner", model, "--calibrate-world", "0"]
    cpu, gpu = ("--calibrate-device", "cpu"), ("--calibrate-device", "cuda")
    # torch.compile after dedicate, inductor on the GPU: the ZeRO-3-like owner mode (every
    # hook DMuon installs) and sharded mode (FSDP2's own hooks); aot_eager in the dry run
    cc = ("--modes", "owner_ddp_z3,sharded")
    dev = ("--device", "cuda")

    def check(budget: int, tests: int) -> list[str]:
        # gpu_check's own budget, and the part of it its GPU tests may take (+15 s for
        # pytest to report after the SIGINT at the limit): the rest times the kernels
        return ["--budget", str(budget), "--test-limit", str(tests)]

    if mode == "dry-run":
        return [
            ("gpu_check", [py, str(b / "gpu_check.py"), "--dry-run", *check(240, 120), *o], 300),
            (
                "step_single",
                [py, str(b / "step.py"), "--single", "--dry-run", "--device", "cpu", *o],
                240,
            ),
            ("kernels", [py, str(b / "kernels.py"), "--dry-run", "--device", "cpu", *o], 120),
            ("tp_gram", [py, str(b / "tp_gram.py"), "--dry-run", "--device", "cpu", *tp], 60),
            ("profile", [py, str(b / "profile_ns.py"), "--dry-run", *o], 120),
            (
                "calibrate",
                [*plan, "--calibrate", str(out / "plan-profile-cpu.json"), *cpu, "--json"],
                120,
            ),
            ("compile", [py, str(b / "compile_check.py"), "--dry-run", *cc, *o], 90),
            ("step_overhead", [py, str(b / "step_overhead.py"), "--quick", "--no-world", *o], 60),
        ]
    if mode == "quick":
        return [
            ("gpu_check", [py, str(b / "gpu_check.py"), "--quick", *check(95, 65), *o], 105),
            ("step_single", [py, str(b / "step.py"), "--single", "--quick", *o], 25),
            ("kernels", [py, str(b / "kernels.py"), "--quick", *o], 25),
            ("tp_gram", [py, str(b / "tp_gram.py"), "--min-run-time", "0.1", *tp], 15),
            ("step_overhead", [py, str(b / "step_overhead.py"), "--quick", *dev, *o], 10),
        ]
    return [
        ("gpu_check", [py, str(b / "gpu_check.py"), *check(190, 120), *o], 220),
        ("step_single", [py, str(b / "step.py"), "--single", *o], 90),
        ("kernels", [py, str(b / "kernels.py"), "--min-run-time", "0.3", *o], 60),
        ("tp_gram", [py, str(b / "tp_gram.py"), "--min-run-time", "0.3", *tp], 25),
        ("profile", [py, str(b / "profile_ns.py"), "--device", "cuda", "--repeats", "3", *o], 45),
        (
            "calibrate",
            [*plan, "--calibrate", str(out / "plan-profile-cuda.json"), *gpu, "--json"],
            35,
        ),
        ("compile", [py, str(b / "compile_check.py"), *cc, *o], 60),
        ("step_overhead", [py, str(b / "step_overhead.py"), "--rounds", "3", *dev, *o], 25),
    ]


def missing_modules() -> list[tuple[str, str]]:
    return [(m, d) for m, d in NEEDED if importlib.util.find_spec(m) is None]


def install_missing(wheels: pathlib.Path, target: pathlib.Path, log) -> dict[str, Any]:
    """pip-install the missing distributions from ``wheels`` (no index) into ``target``."""
    missing = missing_modules()
    report: dict[str, Any] = {"missing": [d for _, d in missing], "installed": []}
    if not missing:
        return report
    if not wheels.is_dir():
        report["error"] = f"{wheels} does not exist: run --prepare-wheels and carry it"
        return report
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    command += ["--target", str(target), "--quiet", *(d for _, d in missing)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    log.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        report["error"] = f"pip exited {done.returncode} (see log_tail)"
    else:
        report["installed"] = report["missing"]
    return report


def prepare_wheels(folder: pathlib.Path) -> int:
    """Download the wheels the GPU image lacks (for Python 3.12, manylinux x86-64)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:"]
    command += ["--python-version", IMAGE_PYTHON]
    command += [arg for tag in IMAGE_PLATFORMS for arg in ("--platform", tag)]
    command += ["--dest", str(folder), *(d for _, d in NEEDED)]
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        return done.returncode
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{folder}: {len(list(folder.iterdir()))} wheels, {size / 2**20:.1f} MiB")
    if size > WHEELS_LIMIT:
        print(f"over {WHEELS_LIMIT / 2**20:.0f} MiB: the GPU tool will not carry it")
        return 1
    return 0


def versions() -> dict[str, Any]:
    """The benchmarks' ``machine_info`` (date, commit, CPU, torch, GPU, CUDA) plus triton,
    numpy and the GPU's compute capability; what cannot be read is reported, not raised."""
    info: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch

        from benchmarks.common.metrics import machine_info

        info.update(machine_info("cuda" if torch.cuda.is_available() else "cpu"))
        if torch.cuda.is_available():
            info["capability"] = list(torch.cuda.get_device_capability(0))
    except Exception as exc:  # report, do not stop: the steps say what failed
        info["torch"] = f"unavailable: {type(exc).__name__}: {exc}"
    for name in ("triton", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:
            info[name] = f"unavailable: {type(exc).__name__}"
    return info


def run(args: argparse.Namespace) -> int:
    mode = "dry-run" if args.dry_run else ("quick" if args.quick else "full")
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"mode": mode, "versions": versions(), "steps": []}
    if mode != "dry-run" and "gpu" not in summary["versions"]:
        print("No CUDA device: run with --dry-run on a CPU.", file=sys.stderr)
        return 2
    started = time.monotonic()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="dmuon-gpu-run-"))
    site = scratch / "site"
    try:
        with (scratch / "pip.log").open("w") as log:
            summary["wheels"] = install_missing(args.wheels, site, log)
        summary["wheels"]["log_tail"] = (scratch / "pip.log").read_text()[-TAIL:]
        env = dict(os.environ)
        path = [*map(str, SOURCES), str(site), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        for name, command, limit in steps(mode, out):
            summary["steps"].append(run_step(name, command, limit, env, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["bundle"] = bundle(out)
    (out / "gpu-run.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{mode}: {summary['seconds']} s")
    for s in summary["steps"]:
        print(f"  {s['name']:<12} {s['status']:<24} {s['seconds']:>7.1f} s")
    print(f"{BUNDLE} in {out}: {', '.join(summary['bundle'])}")
    return 0 if all(s["status"] == "ok" for s in summary["steps"]) else 1


def bundle(out: pathlib.Path) -> list[str]:
    """Pack every result file in ``out`` into one ``BUNDLE`` tarball (and remove the
    files): the GPU tool returns at most 8 files, and the steps write more. Returns the
    names packed."""
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != BUNDLE)
    if not files:
        return []
    with tarfile.open(out / BUNDLE, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    for f in files:
        f.unlink()
    return [f.name for f in files]


def shown(command: list[str]) -> str:
    """``command`` as the summary records it: no path of this machine (the interpreter is
    ``python``, the repository's files relative to it, the output folder ``$OUT``)."""
    out = os.environ.get("OUT")
    parts = ["python"]
    for arg in command[1:]:
        if out and arg.startswith(out):
            arg = "$OUT" + arg[len(out) :]
        elif arg.startswith(str(ROOT) + os.sep):
            arg = os.path.relpath(arg, ROOT)
        parts.append(arg)
    return " ".join(parts)


def run_step(
    name: str, command: list[str], limit: float, env: dict, scratch: pathlib.Path
) -> dict[str, Any]:
    """Run one step under its limit; its output's tail goes to the summary and stdout."""
    print(f"== {name} (limit {limit:.0f} s): {shown(command)}", flush=True)
    t0 = time.monotonic()
    log_path = scratch / f"{name}.log"
    with log_path.open("w") as log:
        # PYTHONFAULTHANDLER: a step stopped at its limit gets SIGABRT first, so its log
        # ends with the Python stack of every thread (where it was stuck or slow).
        child = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**env, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            code = child.wait(timeout=limit)
            status = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
            child.send_signal(signal.SIGABRT)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    tail = log_path.read_text(errors="replace")[-TAIL:]
    if status != "ok":
        print(tail, flush=True)
    return {
        "name": name,
        "command": shown(command),
        "status": status,
        "seconds": round(time.monotonic() - t0, 1),
        "output_tail": tail,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--quick", action="store_true", help="fewer shapes: under 3 minutes")
    what.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter")
    what.add_argument("--prepare-wheels", action="store_true", help="download the wheels")
    p.add_argument("--wheels", type=pathlib.Path, default=WHEELS, help="folder of wheels")
    default_out = os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "gpu-run")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(default_out))
    args = p.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(args.wheels)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
