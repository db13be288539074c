"""Where the time of a Newton–Schulz call and of an optimizer step goes (torch.profiler).

For each shape it profiles ``dmuon.kernels.orthogonalize`` (standard and Gram) and,
for a small GPT-2-like set of matrices, the optimizer step of DMuon at equal math
(``rule="muon"``, standard iteration, Keller's coefficients), DMuon's default and
``torch.optim.Muon`` (in the dtype of the comparison, see ``benchmarks/step.py``).
Operator self-times are summed into groups:

* ``products``: ``mm``/``bmm``/``addmm``/``addmm_``/``baddbmm``;
* ``norms``: ``linalg_vector_norm`` and other reductions;
* ``casts/copies``: ``copy_``, ``_to_copy``, ``clone``, ``contiguous``;
* ``stack/unstack``: ``stack``, ``cat``, ``split``, ``unbind``, ``index_*``;
* ``elementwise``: the other arithmetic (``div``, ``mul``, ``add``, ``lerp`` …);
* ``other``: everything else (allocation, views, Python-side dispatch).

Prints one table per case and writes ``benchmarks/results/profile-<device>.json``.
Times are medians of interleaved repeats with one torch thread; nothing asserts on
them.

``--device cuda`` profiles on the GPU: operator groups are summed from the CUDA
kernels' self time (``self_device_time_total``), the optimizer steps run on the
Llama-3.2-1B weight shapes of ``benchmarks/step.py`` (16 layers, 112 matrices, bf16
Newton–Schulz), one optimizer at a time, and each case also records how many kernels
it launched. That is the breakdown of the gap between DMuon and ``torch.optim.Muon``
on large matrices (``benchmarks/gpu_run.py`` runs it). CUDA graphs are off while it
profiles (:func:`dmuon.kernels.set_cuda_graphs_enabled`): DMuon replays its
Newton–Schulz calls from CUDA graphs by default, and a graph's replay shows no
``aten::`` operators, so the breakdown of DMuon's rows would read about zero. The
rows are the eager calls; with graphs the kernels are the same and only their
launches cost less (``benchmarks/gpu_check.py`` times both).

    python benchmarks/profile_ns.py              # ~5 minutes on 2 shared cores
    python benchmarks/profile_ns.py --quick
    python benchmarks/profile_ns.py --device cuda   # on a GPU, < 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402
from benchmarks.step import LLAMA1B, TINY, Config, TorchMuonFP32, ns_dtype  # noqa: E402
from dmuon.kernels import cuda_graphs_enabled, orthogonalize, set_cuda_graphs_enabled  # noqa: E402
from dmuon.optim import DMuon  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
SHAPES = [(768, 768), (768, 3072), (3072, 768), (1024, 3584)]
QUICK_SHAPES = [(384, 1536), (1536, 384)]
GROUPS = {
    # addmm_: a baddbmm writing a tall matrix's layout (out=, CPU) runs one per matrix
    "products": {"mm", "bmm", "addmm", "addmm_", "baddbmm", "matmul"},
    "norms": {"linalg_vector_norm", "norm", "amax", "max", "sum", "isfinite", "all", "any"},
    "casts/copies": {"copy_", "_to_copy", "to", "clone", "contiguous"},
    "stack/unstack": {"stack", "cat", "split", "unbind", "index_select", "index_copy_"},
    "elementwise": {
        "div",
        "div_",
        "mul",
        "mul_",
        "add",
        "add_",
        "sub",
        "sub_",
        "lerp",
        "lerp_",
        "abs",
        "where",
        "clamp",
        "clamp_",
        "addcmul_",
        "_foreach_mul_",
        "_foreach_add_",
        "_foreach_lerp_",
        "_foreach_div_",
        "_foreach_addcmul_",
    },
}


def group_of(name: str) -> str:
    op = name.removeprefix("aten::")
    for group, ops in GROUPS.items():
        if op in ops:
            return group
    return "other"


def breakdown(fn: Callable[[], Any], repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Median wall time of ``fn`` and the profiled self-time of its operators by group
    (CPU operators' self time on a CPU; CUDA kernels' self time, by the operator that
    launched them, on a GPU)."""
    cuda = device == "cuda"

    def run() -> None:
        fn()
        if cuda:
            torch.cuda.synchronize()

    run()
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
    groups: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        g = group_of(event.key)
        self_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        groups[g] += self_us / 1e3  # ms
        calls[event.key.removeprefix("aten::")] += event.count
    total = sum(groups.values())
    out: dict[str, Any] = {
        "wall_ms": statistics.median(walls) * 1e3,
        "profiled_ms": total,
        "groups_ms": dict(groups),
        "calls": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
    }
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["cuda_kernels"] = len(kernels)
        out["device_ms"] = sum(e.self_device_time_total for e in kernels) / 1e3
    return out


def ns_cases(shapes, dtype: torch.dtype, repeats: int, device: str = "cpu") -> list[dict[str, Any]]:
    out = []
    for m, n in shapes:
        G = torch.randn(m, n, generator=torch.Generator().manual_seed(0)).to(device)
        for method in ("standard", "gram"):
            r = breakdown(
                lambda G=G, method=method: orthogonalize(
                    G, method=method, compute_dtype=dtype, backend="torch"
                ),
                repeats,
                device,
            )
            out.append({"case": f"orthogonalize {method} {m}x{n}", **r})
    return out


def step_cases(
    dtype: torch.dtype, repeats: int, quick: bool, device: str = "cpu", dry_run: bool = False
) -> list[dict[str, Any]]:
    if device == "cuda" or dry_run:
        cfg = Config("tiny", 2, TINY) if dry_run else Config("llama-1b", 16, LLAMA1B)
        shapes, label = cfg.shapes(), f"{len(cfg.shapes())} matrices of {cfg.name}"
    else:
        width = 192 if quick else 384  # the GPT of width 384, 4 layers: 16 matrices
        shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * 4
        label = f"{len(shapes)} matrices of width {width}"
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    name = str(dtype).removeprefix("torch.")
    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "torch.optim.Muon": lambda: torch.optim.Muon(params, lr=0.02, adjust_lr_fn="original"),
        "DMuon equal math (standard, keller)": lambda: DMuon(
            params,
            rule="muon",
            ns_method="standard",
            ns_coefficients="keller",
            ns_compute_dtype=name,
        ),
        "DMuon default (gram, polar_express)": lambda: DMuon(params, rule="muon"),
    }
    if dtype == torch.float32:
        makers["torch.optim.Muon"] = lambda: TorchMuonFP32(params, lr=0.02, adjust_lr_fn="original")
    out = []
    for case, make in makers.items():
        opt = make()
        r = breakdown(opt.step, repeats, device)
        out.append({"case": f"step {case}, {label}", **r})
        del opt
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["products", "norms", "casts/copies", "stack/unstack", "elementwise", "other"]
    print(f"{'case':<62} {'wall ms':>8} " + " ".join(f"{c[:12]:>12}" for c in cols) + " kernels")
    for r in rows:
        total = r["profiled_ms"] or 1.0
        shares = " ".join(f"{100 * r['groups_ms'].get(c, 0.0) / total:>11.1f}%" for c in cols)
        print(f"{r['case']:<62} {r['wall_ms']:>8.1f} {shares} {r.get('cuda_kernels', '')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, one repeat (CI)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shared-machine", action="store_true", help="record a shared machine")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    dtype = ns_dtype(args.device)
    repeats = 1 if args.dry_run else args.repeats
    shapes = QUICK_SHAPES if args.quick or args.dry_run else SHAPES
    if args.device == "cuda" and not args.dry_run:
        shapes = [(2048, 8192), (4096, 14336)]
    load_before = os.getloadavg()[0]
    graphs = cuda_graphs_enabled()
    # a graph's replay hides its operators from the profiler: profile the eager calls
    set_cuda_graphs_enabled(False)
    try:
        rows = ns_cases(shapes, dtype, repeats, args.device)
        rows += step_cases(dtype, repeats, args.quick, args.device, args.dry_run)
    finally:
        set_cuda_graphs_enabled(graphs)
    if args.device == "cuda":
        print(
            "CUDA graphs off while profiling (a replay shows no aten:: operators): DMuon's "
            "rows are its eager calls; with graphs (its default) only the launches cost less"
        )
    print_table(rows)
    meta = {
        **machine_info(args.device),
        "cuda_graphs": False,
        "dtype": str(dtype).removeprefix("torch."),
        "shared_machine": args.shared_machine,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"profile-{args.device}" + ("-quick" if args.quick else "")
    stem += "-dry-run" if args.dry_run else ""
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
