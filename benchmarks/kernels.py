"""Newton–Schulz kernels benchmark: standard vs Gram, batched vs loop, per compute dtype.

For matrix shapes of real models (GPT-2 small, Llama-style MLPs; scaled down on
CPU) it times ``dmuon.kernels.orthogonalize`` and reports, side by side:

* time, matrix-product FLOPs (``ns_flops``) and achieved FLOP/s;
* the achieved rate as a fraction of one plain ``torch.bmm`` (X Xᵀ) of the same
  dtype, batch and size on the same machine (the practical ceiling);
* Gram / standard time ratio (target: ≤ 0.75 for aspect ratio ≥ 4);
* batched / loop speed-up for batches of 8 same-shape matrices (target: ≥ 1.5×
  for 8 × 256 × 1024 on CPU).

Writes ``benchmarks/results/kernels-<device>[-quick][-dry-run][-<tag>].json`` and
``.png`` and prints a table.
Timings use ``torch.utils.benchmark`` with all of the process's threads; nothing
here asserts on time.

    python benchmarks/kernels.py              # full run on the default device
    python benchmarks/kernels.py --quick      # a one-minute subset
    python benchmarks/kernels.py --device cuda
    python benchmarks/kernels.py --tag nobf16 # writes kernels-cpu-nobf16.json and .png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any

import torch
import torch.utils.benchmark as tb

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import file_tag, machine_info  # noqa: E402
from benchmarks.common.progress import progress  # noqa: E402
from dmuon.kernels import ns_flops, orthogonalize  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"

# (label, m, n): GPT-2 small (768), Llama-style layers; the larger ones are the
# 2048×8192 / 4096×14336 shapes scaled to what a 2-core CPU runs in seconds.
CPU_SHAPES = [
    ("gpt2 attn 768x768", 768, 768),
    ("gpt2 mlp 768x3072", 768, 3072),
    ("llama mlp /4 1024x3584", 1024, 3584),
    ("1.3B mlp 2048x8192", 2048, 8192),
    ("tall 4096x512 (AR 8)", 4096, 512),
]
CUDA_SHAPES = [
    ("gpt2 mlp 768x3072", 768, 3072),
    ("1.3B mlp 2048x8192", 2048, 8192),
    ("llama-8B attn 4096x4096", 4096, 4096),
    ("llama-8B kv 1024x4096", 1024, 4096),
    ("llama-8B mlp 4096x14336", 4096, 14336),
]
QUICK_SHAPES = [("gpt2 attn 768x768", 768, 768), ("gpt2 mlp 768x3072", 768, 3072)]
# --dry-run: every code path at toy sizes (benchmarks/gpu_run.py runs it on a CPU in CI).
DRY_RUN_SHAPES = [("toy 32x96", 32, 96), ("toy tall 96x32", 96, 32)]
# Same-shape batches: 8 × 256×1024 is the target case; 32 × 64×256 shows the
# launch-bound regime (many small matrices) where batching matters most.
BATCHES = [
    ("8 x 256x1024", 8, 256, 1024),
    ("8 x 768x768", 8, 768, 768),
    ("32 x 64x256", 32, 64, 256),
]


@dataclasses.dataclass
class Row:
    case: str
    shape: str
    batch: int
    method: str
    dtype: str
    mode: str  # "batched" | "loop"
    seconds: float
    flops: int
    tflops: float
    mm_tflops: float
    frac_of_mm: float


def timeit(fn, min_run_time: float) -> float:
    timer = tb.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def mm_rate(
    batch: int, m: int, n: int, dtype: torch.dtype, device: str, min_run_time: float
) -> float:
    """FLOP/s of X @ Xᵀ (m×n by n×m, batched like the case) — the largest product an NS
    step issues, run as one vendor call: the practical ceiling for this case."""
    s, l = min(m, n), max(m, n)
    X = torch.randn(batch, s, l, dtype=dtype, device=device)
    t = timeit(lambda: torch.bmm(X, X.mT), min_run_time)
    return 2 * batch * s * s * l / t


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def dtypes_for(device: str, asked: str | None = None) -> list[torch.dtype]:
    """``--dtypes`` if given; else CUDA: fp16 (Gram's default) and bf16; a CPU with native
    bf16: bf16 (its fast path) and fp32; any other CPU: fp32, the fast path there (bf16
    products are emulated, 768×768 took 20 s a call; fp16 matmul is slower still)."""
    if asked:
        return [DTYPES[d.strip()] for d in asked.split(",") if d.strip()]
    if device == "cuda":
        return [torch.float16, torch.bfloat16]
    from dmuon.kernels import cpu_has_native_bf16

    return [torch.bfloat16, torch.float32] if cpu_has_native_bf16() else [torch.float32]


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    shapes = QUICK_SHAPES if args.quick else (CUDA_SHAPES if device == "cuda" else CPU_SHAPES)
    batches = BATCHES[:1] if args.quick else BATCHES
    min_run = 0.2 if args.quick else args.min_run_time
    if args.dry_run:
        shapes, batches, min_run = DRY_RUN_SHAPES, [("4 x 16x48", 4, 16, 48)], 0.01
    cases = [(label, 1, m, n) for label, m, n in shapes] + list(batches)
    jobs = [
        (label, batch, m, n, dtype, method, mode)
        for label, batch, m, n in cases
        for dtype in dtypes_for(device, args.dtypes)
        for method in ("standard", "gram")
        for mode in (("batched", "loop") if batch > 1 else ("batched",))
    ]
    rows: list[Row] = []
    ceilings: dict[tuple[int, int, int, torch.dtype], float] = {}
    with progress(width=40) as bar:
        task = bar.add_task("orthogonalize", total=len(jobs))
        for label, batch, m, n, dtype, method, mode in jobs:
            bar.update(task, description=f"{label} {method} {str(dtype)[6:]} {mode}")
            key = (batch, m, n, dtype)
            if key not in ceilings:
                ceilings[key] = mm_rate(batch, m, n, dtype, device, min_run)
            ceiling = ceilings[key]
            G = (
                torch.randn(batch, m, n, device=device)
                if batch > 1
                else torch.randn(m, n, device=device)
            )
            if mode == "batched":

                def fn(G=G, method=method, dtype=dtype):
                    return orthogonalize(G, method=method, compute_dtype=dtype)
            else:

                def fn(G=G, method=method, dtype=dtype):
                    return [orthogonalize(g, method=method, compute_dtype=dtype) for g in G]

            fn()  # warm-up
            secs = timeit(fn, min_run)
            flops = ns_flops(m, n, method=method, batch=batch)
            rows.append(
                Row(
                    label,
                    f"{m}x{n}",
                    batch,
                    method,
                    str(dtype).split(".")[-1],
                    mode,
                    secs,
                    flops,
                    flops / secs / 1e12,
                    ceiling / 1e12,
                    flops / secs / ceiling,
                )
            )
            bar.advance(task)
    return {
        "meta": machine_info(device),
        "rows": [dataclasses.asdict(r) for r in rows],
        "summary": summarise(rows),
    }


def summarise(rows: list[Row]) -> dict[str, Any]:
    """The two targets of the foundation issue, computed from the rows."""
    by = {(r.case, r.dtype, r.method, r.mode): r for r in rows}
    gram_vs_standard = []
    for (case, dtype, method, mode), r in by.items():
        if method != "gram" or mode != "batched":
            continue
        s = by[(case, dtype, "standard", mode)]
        m, n = map(int, r.shape.split("x"))
        gram_vs_standard.append(
            {
                "case": case,
                "dtype": dtype,
                "aspect_ratio": max(m, n) / min(m, n),
                "gram_over_standard": r.seconds / s.seconds,
            }
        )
    batched_vs_loop = []
    for (case, dtype, method, mode), r in by.items():
        if mode != "loop":
            continue
        b = by[(case, dtype, method, "batched")]
        batched_vs_loop.append(
            {"case": case, "dtype": dtype, "method": method, "speedup": r.seconds / b.seconds}
        )
    return {"gram_over_standard": gram_vs_standard, "batched_speedup": batched_vs_loop}


def print_table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    from rich.console import Console
    from rich.table import Table

    header = ["case", "batch", "dtype", "method", "mode", "ms", "TFLOP/s", "mm TFLOP/s", "of mm"]
    body = [
        [
            r["case"],
            str(r["batch"]),
            r["dtype"],
            r["method"],
            r["mode"],
            f"{r['seconds'] * 1e3:.2f}",
            f"{r['tflops']:.3f}",
            f"{r['mm_tflops']:.3f}",
            f"{r['frac_of_mm']:.0%}",
        ]
        for r in rows
    ]
    table = Table(
        title=f"Newton–Schulz on {result['meta']['device']} "
        f"({result['meta'].get('gpu', result['meta']['cpu'])})"
    )
    for h in header:
        table.add_column(h, justify="right" if h not in ("case", "method", "mode") else "left")
    for b in body:
        table.add_row(*b)
    Console(width=140).print(table)
    print("\nGram / standard time (target ≤ 0.75 for aspect ratio ≥ 4):")
    for g in result["summary"]["gram_over_standard"]:
        print(
            f"  {g['case']:<26} {g['dtype']:<9} AR {g['aspect_ratio']:.1f}: "
            f"{g['gram_over_standard']:.2f}"
        )
    print("Batched speed-up over a loop (target ≥ 1.5× for 8 × 256x1024 on CPU):")
    for b in result["summary"]["batched_speedup"]:
        print(f"  {b['case']:<14} {b['dtype']:<9} {b['method']:<9}: {b['speedup']:.2f}×")


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["mode"] == "batched"]
    dtypes = sorted({r["dtype"] for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        width = 0.38
        for k, method in enumerate(("standard", "gram")):
            vals = []
            for c in cases:
                match = [
                    r
                    for r in rows
                    if r["case"] == c and r["dtype"] == dtype and r["method"] == method
                ]
                vals.append(match[0]["seconds"] * 1e3 if match else 0.0)
            xs = [i + (k - 0.5) * width for i in range(len(cases))]
            ax.bar(xs, vals, width, label=method)
        ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms per orthogonalize call")
        ax.set_title(f"{dtype} on {result['meta']['device']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small subset, about a minute on CPU")
    p.add_argument("--dry-run", action="store_true", help="toy shapes (checks the code)")
    p.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    p.add_argument(
        "--dtypes",
        help="comma-separated among fp16, bf16, fp32 (default: the device's fast ones)",
    )
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument(
        "--tag",
        type=file_tag,
        default="",
        help="suffix of the result files: --tag nobf16 writes kernels-<device>-nobf16.json",
    )
    args = p.parse_args(argv)
    if args.dtypes and (bad := [d for d in args.dtypes.split(",") if d.strip() not in DTYPES]):
        p.error(f"--dtypes: {bad} not among {', '.join(DTYPES)}")
    torch.manual_seed(0)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"kernels-{args.device}" + ("-quick" if args.quick else "")
    stem += ("-dry-run" if args.dry_run else "") + args.tag
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / f"{stem}.png")
    print_table(result)
    print(f"\nwrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
