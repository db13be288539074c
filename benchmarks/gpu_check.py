"""GPU check of dmuon-kernels: kernel tests compiled on the GPU, symmetric kernels vs
cuBLAS, whole Newton–Schulz calls, in one command without network access.

    python benchmarks/gpu_check.py             # full check, < 8 min on one H100/H200
    python benchmarks/gpu_check.py --quick     # fewer shapes and repeats (~2 min)
    python benchmarks/gpu_check.py --dry-run   # on a CPU: validates the plan, every
                                               # measurement path (tiny shapes, Triton
                                               # interpreter) and the JSON writer

What it does, in order:

1. runs the tests of ``packages/dmuon-kernels/tests`` that exercise CUDA (``GPU_TESTS``:
   the Triton kernels, the autotuner, the CUDA graphs, a tensor on a second GPU) with
   ``DMUON_TRITON_COMPILED=1``: the Triton tests on CUDA tensors with compiled kernels
   instead of the interpreter, plus the real CUDA-graph capture tests (one autotune
   config per kernel to bound compile time), under their own limit (``--test-limit``);
   the rest of the suite is CPU code that CI runs;
2. times ``syrk`` against ``X @ X.mT``, ``sym_poly`` against ``baddbmm`` (``bA + cA²``)
   and ``sym_mul`` against ``baddbmm`` (``A·B + aA``) in fp16 and bf16, with the
   largest difference from the torch result;
3. times whole ``orthogonalize`` calls for the Llama-3-8B layer shapes (4096×4096,
   1024×4096, 14336×4096) and batches of them: standard vs Gram × torch / triton /
   auto × CUDA graphs off / on, with achieved FLOP/s (``ns_flops``) against the
   measured dense GEMM rate (``X @ X.mT`` at 4096×14336) and the autotuner's
   decisions (fresh cache in a temporary directory);
4. writes ``gpu-check-<gpu>.json`` (GPU name, driver, versions, every figure, the
   targets) and a PNG into ``--out`` (default ``$OUT`` when set: on the GPU machine only
   the files under it come back; else ``benchmarks/results``), and prints the tables.

Targets it reports (never asserts): syrk ≥ 1.5× faster than ``X @ X.mT`` at
4096×14336 in fp16/bf16; Gram NS with the Triton kernels ≥ 1.5× faster than standard
NS with cuBLAS at 14336×4096; achieved FLOP/s of the whole call ≥ 60 % of the dense
GEMM rate. It uses this checkout's ``packages/dmuon-kernels/src`` (no install needed);
torch and triton must be installed, pytest/hypothesis for step 1, rich and matplotlib
are optional.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS_SRC = ROOT / "packages" / "dmuon-kernels" / "src"
TESTS = ROOT / "packages" / "dmuon-kernels" / "tests"
RESULTS = ROOT / "benchmarks" / "results"
# The kernel tests that run CUDA code where CUDA is there (compiled Triton kernels on CUDA
# tensors under DMUON_TRITON_COMPILED=1, real CUDA-graph captures, a second GPU); the rest
# of the suite is CPU code, which CI runs. test_gpu_check_dry_run.py checks this list
# against the test files (each that imports tritonref's DEVICE/COMPILED or asks
# torch.cuda whether a device is there).
GPU_TESTS = (
    "test_autotune.py",
    "test_cuda_device.py",
    "test_cuda_graphs.py",
    "test_triton_kernels.py",
    "test_triton_orthogonalize.py",
)
TEST_TAIL = 6000  # characters of pytest's output kept in the JSON

# (label, batch, rows, cols) of orthogonalize inputs: one Llama-3-8B layer and batches.
LLAMA_NS = [
    ("attn q/o 4096x4096", 1, 4096, 4096),
    ("attn k/v 1024x4096", 1, 1024, 4096),
    ("mlp up/gate 14336x4096", 1, 14336, 4096),
    ("8 x k/v 1024x4096", 8, 1024, 4096),
    ("4 x q/o 4096x4096", 4, 4096, 4096),
    ("3 x mlp 14336x4096", 3, 14336, 4096),
]
QUICK_NS = [LLAMA_NS[1], LLAMA_NS[2], LLAMA_NS[3]]
# (op, batch, m, k): syrk is (B, m, k) → (B, m, m); sym_poly and sym_mul are (B, m, m).
KERNELS = [
    ("syrk", 1, 4096, 4096),
    ("syrk", 1, 1024, 4096),
    ("syrk", 1, 4096, 14336),
    ("syrk", 8, 1024, 4096),
    ("syrk", 3, 4096, 14336),
    ("sym_poly", 1, 4096, 4096),
    ("sym_poly", 1, 1024, 1024),
    ("sym_poly", 8, 1024, 1024),
    ("sym_mul", 1, 4096, 4096),
    ("sym_mul", 1, 1024, 1024),
    ("sym_mul", 8, 1024, 1024),
]
QUICK_KERNELS = [KERNELS[2], KERNELS[5], KERNELS[8]]
DRY_RUN_SCALE = 128  # --dry-run divides every size by this (interpreter on a CPU)


@dataclasses.dataclass(frozen=True)
class KernelCase:
    op: str
    batch: int
    m: int
    k: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class NSCase:
    label: str
    batch: int
    rows: int
    cols: int
    method: str
    backend: str
    graphs: bool


def build_plan(quick: bool, dry_run: bool) -> dict[str, list]:
    """Every measurement the check makes, in order (sizes scaled down for --dry-run)."""
    scale = DRY_RUN_SCALE if dry_run else 1
    kernels = QUICK_KERNELS if quick else KERNELS
    ns = QUICK_NS if quick else LLAMA_NS
    dtypes = ["float16", "bfloat16"]
    cap = 2 if dry_run else 1 << 30  # the interpreter pays per program: keep batches small
    kernel_cases = [
        KernelCase(op, min(b, cap), max(8, m // scale), max(8, k // scale), dt)
        for op, b, m, k in kernels
        for dt in dtypes
    ]
    ns_cases = [
        NSCase(label, min(b, cap), max(8, r // scale), max(8, c // scale), method, backend, graphs)
        for label, b, r, c in ns
        for method in ("standard", "gram")
        for backend in ("torch", "triton", "auto")
        for graphs in (False, True)
    ]
    return {"kernels": kernel_cases, "ns": ns_cases}


def describe(case: KernelCase | NSCase) -> str:
    if isinstance(case, KernelCase):
        return f"{case.op} {case.batch}x{case.m}x{case.k} {case.dtype}"
    graphs = "graphs" if case.graphs else "eager"
    return (
        f"{case.label} ({case.batch}x{case.rows}x{case.cols}) {case.method} {case.backend} {graphs}"
    )


def validate_plan(plan: dict[str, list]) -> dict[str, Any]:
    """Check a plan without running it: no duplicates, FLOPs computable, memory bounded.

    The peak memory estimate of an orthogonalize case is the fp32 input, its fp32
    normalised copy, the result and about six (B, m, n)/(B, m, m) buffers of the
    iteration in the compute dtype; of a kernel case, three operands of (B, m, max(m, k)).
    """
    from dmuon.kernels import ns_flops

    for name, cases in plan.items():
        if len(set(cases)) != len(cases):
            raise ValueError(f"plan {name!r} lists a case twice")
    peak = 0
    total_flops = 0
    for c in plan["ns"]:
        m, n = sorted((c.rows, c.cols))
        total_flops += ns_flops(c.rows, c.cols, method=c.method, batch=c.batch)
        peak = max(peak, c.batch * (3 * 4 * m * n + 6 * 2 * (m * n + m * m)))
    for c in plan["kernels"]:
        peak = max(peak, 3 * c.batch * c.m * max(c.m, c.k) * 2)
    return {
        "kernel_cases": len(plan["kernels"]),
        "ns_cases": len(plan["ns"]),
        "ns_flops_per_pass": total_flops,
        "peak_memory_gib_estimate": round(peak / 2**30, 2),
    }


# -- environment -----------------------------------------------------------------------


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def machine_info(device: str, dry_run: bool) -> dict[str, Any]:
    import torch

    import dmuon.kernels

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "dry_run": dry_run,
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "dmuon_kernels": dmuon.kernels.__version__,
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
            driver=driver_version(),
        )
    return info


# -- step 1: the tests on the GPU ------------------------------------------------------


def test_command() -> list[str]:
    """pytest on :data:`GPU_TESTS`, with each skip's reason and the slowest tests listed."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "--durations=15",
        "-p",
        "no:cacheprovider",
        *GPU_TESTS,
    ]


def run_tests(device: str, timeout: float) -> dict[str, Any]:
    """Run :func:`test_command` in the kernel tests' folder, stopped after ``timeout`` s.

    At the limit pytest gets SIGINT first: it then prints where it was and the summary of
    what ran, which the JSON keeps (the tail of the output), before it is killed."""
    command = test_command()
    if device != "cuda":
        return {"command": " ".join(["python", *command[1:]]), "status": "skipped: needs CUDA"}
    import importlib.util

    missing = [m for m in ("pytest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:
        return {
            "command": " ".join(["python", *command[1:]]),
            "status": f"skipped: {', '.join(missing)} missing",
        }
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.update(DMUON_TRITON_COMPILED="1", DMUON_TRITON_AUTOTUNE="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(KERNELS_SRC), env.get("PYTHONPATH")]))
    return run_limited(command, timeout, env, TESTS)


def _default_sigint() -> None:
    """In the child, before its program starts: SIGINT back to its default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_limited(
    command: list[str], timeout: float, env: dict[str, str], cwd: pathlib.Path
) -> dict[str, Any]:
    """``command`` with its output captured, stopped at ``timeout`` seconds (SIGINT, then
    after 15 s a kill); the status, pytest's counts, the seconds and the output's tail."""
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+", errors="replace") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            # a launcher run in the background (nohup, `&`) ignores SIGINT, and its children
            # inherit that: pytest would never see the SIGINT below
            preexec_fn=_default_sigint,
        )
        try:
            code = proc.wait(timeout=timeout)
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
            proc.send_signal(signal.SIGINT)  # pytest prints where it was and the summary
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        output = log.read()
    counts = {
        word: int(n)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", output)
    }
    return {
        "command": " ".join(["python", *command[1:]]),
        "status": status,
        "counts": counts,
        "seconds": round(time.perf_counter() - start, 1),
        "output_tail": output[-TEST_TAIL:],
    }


# -- timing ----------------------------------------------------------------------------


def make_timer(device: str, warmup: int, repeat: int) -> Callable[[Callable[[], object]], float]:
    import torch

    def cuda_timer(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def cpu_timer(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    return cuda_timer if device == "cuda" else cpu_timer


def max_rel_diff(a, b) -> float:
    import torch

    a, b = a.to(torch.float64), b.to(torch.float64)
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max())


# -- step 2: kernels -------------------------------------------------------------------


def kernel_row(case: KernelCase, device: str, timer) -> dict[str, Any]:
    import torch

    from dmuon.kernels.symmetric_ops import sym_mul_torch, sym_poly_torch, syrk_torch
    from dmuon.kernels.triton import sym_mul, sym_poly, syrk

    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    b, m, k = case.batch, case.m, case.k
    if case.op == "syrk":
        X = torch.randn(b, m, k, device=device, generator=g).div_(k**0.5).to(dtype)
        run_triton, run_torch = (lambda: syrk(X)), (lambda: syrk_torch(X))
        flops = 2 * b * m * m * k  # what the full product X @ X.mT costs
    else:
        X = torch.randn(b, m, 3 * m, device=device, generator=g)
        A = (X @ X.mT / (3 * m)).to(dtype)
        Z = sym_poly_torch(A, -4.775, 2.0315)
        if case.op == "sym_poly":
            run_triton = lambda: sym_poly(A, -4.775, 2.0315)  # noqa: E731
            run_torch = lambda: sym_poly_torch(A, -4.775, 2.0315)  # noqa: E731
        else:
            run_triton = lambda: sym_mul(A, Z, 3.4445)  # noqa: E731
            run_torch = lambda: sym_mul_torch(A, Z, 3.4445)  # noqa: E731
        flops = 2 * b * m**3
    diff = max_rel_diff(run_triton(), run_torch())  # also compiles and autotunes
    t_triton, t_torch = timer(run_triton), timer(run_torch)
    return {
        **dataclasses.asdict(case),
        "status": "ok",
        "triton_ms": t_triton * 1e3,
        "torch_ms": t_torch * 1e3,
        "speedup": t_torch / t_triton,
        "torch_tflops": flops / t_torch / 1e12,
        "triton_effective_tflops": flops / t_triton / 1e12,
        "max_rel_diff": diff,
    }


def gemm_rate(dtype_name: str, device: str, timer, dry_run: bool) -> float:
    """FLOP/s of the dense X @ X.mT at 4096×14336: the ceiling the NS calls are measured against."""
    import torch

    scale = DRY_RUN_SCALE if dry_run else 1
    m, k = 4096 // scale, 14336 // scale
    X = torch.randn(m, k, device=device).to(getattr(torch, dtype_name))
    return 2 * m * m * k / timer(lambda: X @ X.mT)


# -- step 3: whole calls ---------------------------------------------------------------


def ns_row(case: NSCase, device: str, timer, gemm: dict[str, float]) -> dict[str, Any]:
    import torch

    from dmuon.kernels import (
        default_autotuner,
        default_compute_dtype,
        ns_flops,
        orthogonalize,
        release_cuda_graphs,
    )
    from dmuon.kernels.ns_options import default_restarts

    row: dict[str, Any] = dataclasses.asdict(case)
    if case.graphs and device != "cuda":
        return {**row, "status": "skipped: CUDA graphs need CUDA"}
    dtype = default_compute_dtype(device, case.method)
    shape = (case.rows, case.cols) if case.batch == 1 else (case.batch, case.rows, case.cols)
    g = torch.Generator(device=device).manual_seed(1)
    G = torch.randn(shape, device=device, generator=g)
    kw = dict(method=case.method, backend=case.backend, cuda_graph=case.graphs)

    def call():
        return orthogonalize(G, **kw)

    first = call()  # compile, autotune, first eager call
    reference = orthogonalize(G, method=case.method, backend="torch", cuda_graph=False)
    seconds = timer(call)  # the warm-up inside also captures the graph (2nd call)
    release_cuda_graphs()
    flops = ns_flops(case.rows, case.cols, method=case.method, batch=case.batch)
    dtype_name = str(dtype).removeprefix("torch.")
    row.update(
        status="ok",
        compute_dtype=dtype_name,
        ms=seconds * 1e3,
        flops=flops,
        tflops=flops / seconds / 1e12,
        frac_of_gemm=flops / seconds / gemm[dtype_name] if dtype_name in gemm else None,
        max_rel_diff_vs_torch=max_rel_diff(first, reference),
    )
    if case.backend == "auto":
        m, n = sorted((case.rows, case.cols))
        if device == "cuda" and m >= 64:
            tuner = default_autotuner()
            restarts = default_restarts(5, dtype) if case.method == "gram" else ()
            key = tuner.key(G.device, case.method, case.batch, m, n, dtype, 5, restarts)
            decision = tuner.lookup(key)
            row["auto_decision"] = decision.to_json() if decision else None
        else:
            row["auto_decision"] = {"winner": "torch", "reason": "not CUDA or below one tile"}
    return row


# -- summary, output -------------------------------------------------------------------


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    kernels = [r for r in result["kernels"] if r.get("status") == "ok"]
    ns = [r for r in result["ns"] if r.get("status") == "ok"]
    big_syrk = [r for r in kernels if r["op"] == "syrk" and r["batch"] == 1 and r["k"] > r["m"]]
    big_syrk = [r for r in big_syrk if r["m"] == max(x["m"] for x in big_syrk)] if big_syrk else []
    targets: dict[str, Any] = {
        "syrk_speedup_4096x14336": {
            r["dtype"]: {"speedup": r["speedup"], "target": 1.5, "met": r["speedup"] >= 1.5}
            for r in big_syrk
        }
    }
    mlp = [
        r
        for r in ns
        if r["batch"] == 1 and max(r["rows"], r["cols"]) / min(r["rows"], r["cols"]) > 3
    ]
    mlp = (
        [r for r in mlp if r["rows"] * r["cols"] == max(x["rows"] * x["cols"] for x in mlp)]
        if mlp
        else []
    )

    def pick(method, backend, graphs=False):
        hits = [
            r for r in mlp if (r["method"], r["backend"], r["graphs"]) == (method, backend, graphs)
        ]
        return hits[0] if hits else None

    gram_triton, std_torch = pick("gram", "triton"), pick("standard", "torch")
    if gram_triton and std_torch:
        speedup = std_torch["ms"] / gram_triton["ms"]
        targets["gram_triton_vs_standard_torch_14336x4096"] = {
            "speedup": speedup,
            "target": 1.5,
            "met": speedup >= 1.5,
        }
    fractions = [r for r in ns if r.get("frac_of_gemm") is not None]
    if fractions:
        best = max(fractions, key=lambda r: r["frac_of_gemm"])
        headline = gram_triton or best
        targets["ns_fraction_of_gemm_rate"] = {
            "headline_case": f"{headline['label']} {headline['method']} {headline['backend']}",
            "headline": headline["frac_of_gemm"],
            "best_case": (
                f"{best['label']} {best['method']} {best['backend']} graphs={best['graphs']}"
            ),
            "best": best["frac_of_gemm"],
            "target": 0.6,
            "met": headline["frac_of_gemm"] >= 0.6,
        }
    graph_gain = []
    for r in ns:
        if r["graphs"]:
            twin = [
                x
                for x in ns
                if not x["graphs"]
                and (x["label"], x["method"], x["backend"])
                == (r["label"], r["method"], r["backend"])
            ]
            if twin:
                graph_gain.append(
                    {
                        "case": f"{r['label']} {r['method']} {r['backend']}",
                        "speedup": twin[0]["ms"] / r["ms"],
                    }
                )
    return {"targets": targets, "cuda_graph_speedups": graph_gain}


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print a plain aligned table: text columns left, numbers right."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    numeric = [
        all(re.fullmatch(r"[-+0-9.e%x]*", str(r[i])) for r in rows) for i in range(len(header))
    ]

    def line(cells):
        return "  ".join(
            str(c).rjust(w) if num else str(c).ljust(w)
            for c, w, num in zip(cells, widths, numeric, strict=True)
        )

    print(f"\n{title}\n{line(header)}\n{'  '.join('-' * w for w in widths)}")
    for r in rows:
        print(line(r))


def print_tables(result: dict[str, Any]) -> None:
    meta = result["meta"]
    where = meta.get("gpu", meta["device"])
    if meta["dry_run"]:
        where += " (DRY RUN: CPU, tiny shapes, Triton interpreter; figures mean nothing)"
    print(f"\ndmuon-kernels GPU check on {where}, {meta['date']}")
    versions = f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}"
    print(f"{versions}, driver {meta.get('driver', '-')}")
    t = result["tests"]
    print(f"Tests: {t['status']} {t.get('counts', '')} {t.get('seconds', '')}")
    rates = ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in result["gemm_flops"].items())
    print(f"Dense GEMM X @ X.mT at 4096x14336: {rates}")
    table(
        "Symmetric kernels vs torch (ms; TFLOP/s counts the full product)",
        ["op", "batch", "m", "k", "dtype", "torch", "triton", "speedup", "TFLOP/s", "max diff"],
        [
            [
                r["op"],
                r["batch"],
                r["m"],
                r["k"],
                r["dtype"],
                f"{r['torch_ms']:.3f}",
                f"{r['triton_ms']:.3f}",
                f"{r['speedup']:.2f}x",
                f"{r['triton_effective_tflops']:.1f}",
                f"{r['max_rel_diff']:.1e}",
            ]
            for r in result["kernels"]
            if r.get("status") == "ok"
        ],
    )
    for r in result["kernels"] + result["skipped"]:
        if r.get("status", "ok") != "ok" or "reason" in r:
            print(f"  not measured: {r} ")
    rows = []
    for r in result["ns"]:
        head = [r["label"], r["method"], r["backend"], "on" if r["graphs"] else "off"]
        if r.get("status") != "ok":
            rows.append([*head, "-", "-", "-", "-", "-", r["status"]])
            continue
        frac = f"{r['frac_of_gemm']:.0%}" if r["frac_of_gemm"] is not None else "-"
        auto = (r.get("auto_decision") or {}).get("winner", "") if r["backend"] == "auto" else ""
        rows.append(
            [
                *head,
                r["compute_dtype"],
                f"{r['ms']:.3f}",
                f"{r['tflops']:.1f}",
                frac,
                f"{r['max_rel_diff_vs_torch']:.1e}",
                auto,
            ]
        )
    table(
        "orthogonalize (default compute dtypes; 'vs torch' = max |diff| / max |torch result|)",
        [
            "case",
            "method",
            "backend",
            "graph",
            "dtype",
            "ms",
            "TFLOP/s",
            "of GEMM",
            "vs torch",
            "auto",
        ],
        rows,
    )
    print("\nTargets:")
    print(json.dumps(result["summary"]["targets"], indent=1))


def plot(result: dict[str, Any], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["ns"] if r.get("status") == "ok"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    series = list(dict.fromkeys((r["method"], r["backend"], r["graphs"]) for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(1, len(series))
    for j, s in enumerate(series):
        vals = [
            next(
                (
                    r["ms"]
                    for r in rows
                    if r["label"] == lab and (r["method"], r["backend"], r["graphs"]) == s
                ),
                0,
            )
            for lab in labels
        ]
        ax1.bar(
            [i + j * width for i in range(len(labels))],
            vals,
            width,
            label=f"{s[0]} {s[1]}{' +graph' if s[2] else ''}",
        )
    ax1.set_xticks(
        [i + 0.4 for i in range(len(labels))], labels, rotation=20, ha="right", fontsize=8
    )
    ax1.set_yscale("log")
    ax1.set_ylabel("ms per orthogonalize call")
    ax1.legend(fontsize=7, ncol=2)
    syrk = [r for r in result["kernels"] if r["op"] == "syrk" and r.get("status") == "ok"]
    ax2.bar(range(len(syrk)), [r["speedup"] for r in syrk])
    ax2.axhline(1.5, color="k", ls="--", lw=0.8)
    ax2.set_xticks(
        range(len(syrk)),
        [
            f"{r['batch']}x{r['m']}x{r['k']} {'fp16' if r['dtype'] == 'float16' else 'bf16'}"
            for r in syrk
        ],
        rotation=60,
        ha="right",
        fontsize=7,
    )
    ax2.set_ylabel("syrk speed-up over X @ X.mT")
    meta = result["meta"]
    fig.suptitle(
        f"dmuon-kernels GPU check: {meta.get('gpu', meta['device'])}"
        + (" (dry run)" if meta["dry_run"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_result(result: dict[str, Any], out: pathlib.Path, stem: str) -> pathlib.Path:
    """Write JSON atomically (a partial file never replaces a complete one)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)
    return path


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# -- main ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--out`` defaults to ``$OUT`` as it is now (the GPU tool's folder)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    p.add_argument("--skip-tests", action="store_true", help="skip step 1")
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(os.environ.get("OUT") or RESULTS),
        help="where the JSON and PNG go (default: $OUT if set, else benchmarks/results)",
    )
    p.add_argument(
        "--budget", type=float, default=420.0, help="seconds; later rows are skipped past it"
    )
    p.add_argument(
        "--test-limit",
        type=float,
        default=150.0,
        help="seconds the GPU tests may take (step 1; within --budget)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    if args.dry_run:
        # Before dmuon.kernels.triton is first imported: run the kernels in the interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(KERNELS_SRC))  # this checkout's code, installed or not
    tune_dir = tempfile.mkdtemp(prefix="dmuon-gpu-check-")
    os.environ["DMUON_KERNELS_CACHE_DIR"] = tune_dir  # fresh autotune decisions

    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device != "cuda" and not args.dry_run:
        print("No CUDA device: run with --dry-run to validate the plan on a CPU.", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget
    full_plan = build_plan(args.quick, dry_run=False)  # what a GPU runs
    plan = build_plan(args.quick or args.dry_run, args.dry_run)  # what this run executes
    warmup, repeat = (1, 1) if args.dry_run else ((3, 5) if args.quick else (3, 10))
    timer = make_timer(device, warmup, repeat)
    result: dict[str, Any] = {"meta": machine_info(device, args.dry_run)}
    try:
        run_check(args, device, timer, full_plan, plan, deadline, result)
    finally:
        shutil.rmtree(tune_dir, ignore_errors=True)
    name = "dry-run-quick" if args.dry_run else slug(result["meta"].get("gpu", device))
    stem = f"gpu-check-{name}" + ("-quick" if args.quick and not args.dry_run else "")
    path = write_result(result, args.out, stem)
    png = args.out / f"{stem}.png"
    plotted = plot(result, png)
    print_tables(result)
    print(f"\nwrote {path}" + (f" and {png}" if plotted else ""))
    tests = str(result["tests"].get("status", ""))
    return 1 if tests.startswith(("failed", "timed out")) else 0


def guarded(measure, case, device, *rest) -> dict[str, Any]:
    """One row; an error (a kernel that fails to compile, out of memory) becomes the row's
    status instead of ending the run, so the other figures still reach the JSON."""
    try:
        return measure(case, device, *rest)
    except Exception as exc:
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
        return {**dataclasses.asdict(case), "status": f"error: {type(exc).__name__}: {exc}"}


def run_check(args, device, timer, full_plan, plan, deadline, result) -> None:
    """Steps 1–3, filling ``result`` in place."""
    result["plan"] = {k: [dataclasses.asdict(c) for c in v] for k, v in full_plan.items()}
    result["plan_check"] = validate_plan(full_plan)
    if args.dry_run:
        result["executed_plan"] = {k: [dataclasses.asdict(c) for c in v] for k, v in plan.items()}

    print("1/3 tests on the GPU ...", flush=True)
    test_limit = args.test_limit
    result["tests"] = (
        {"status": "skipped: --skip-tests"} if args.skip_tests else run_tests(device, test_limit)
    )
    print(f"    {result['tests']['status']}", flush=True)

    from dmuon.kernels import default_compute_dtype

    # the ceiling in each dtype the NS calls run in (fp16/bf16 on CUDA; the CPU's default)
    ns_dtypes = {str(default_compute_dtype(device, m)).split(".")[-1] for m in ("gram", "standard")}
    result["gemm_flops"] = {d: gemm_rate(d, device, timer, args.dry_run) for d in sorted(ns_dtypes)}
    print(f"2/3 symmetric kernels: {len(plan['kernels'])} cases ...", flush=True)
    result["kernels"], result["skipped"] = [], []
    for i, case in enumerate(plan["kernels"], 1):
        if time.monotonic() > deadline:
            result["skipped"].append({**dataclasses.asdict(case), "reason": "time budget"})
            continue
        result["kernels"].append(guarded(kernel_row, case, device, timer))
        print(f"    [{i}/{len(plan['kernels'])}] {describe(case)}", flush=True)
    print(f"3/3 orthogonalize: {len(plan['ns'])} cases ...", flush=True)
    result["ns"] = []
    for i, case in enumerate(plan["ns"], 1):
        if time.monotonic() > deadline:
            result["skipped"].append({**dataclasses.asdict(case), "reason": "time budget"})
            continue
        result["ns"].append(guarded(ns_row, case, device, timer, result["gemm_flops"]))
        print(f"    [{i}/{len(plan['ns'])}] {describe(case)}", flush=True)
    result["summary"] = summarise(result)


if __name__ == "__main__":
    raise SystemExit(main())
