"""Does ``torch.compile`` speed up DMuon's Newton–Schulz? Eager vs compiled, one process.

``dmuon.kernels.orthogonalize`` (Gram Newton–Schulz, fp32, torch backend) on a batch
of the step benchmark's matrix shapes (d_model 384: the 384 × 1536 MLP matrices and
the 384 × 384 attention ones), eager and under ``torch.compile`` (inductor): the
median of 7 calls after the first, the first compiled call's time (compilation) and
the largest difference between the two results. Prints a line per shape and writes
JSON.

    python benchmarks/ns_compile.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402
from dmuon.kernels import orthogonalize  # noqa: E402

SHAPES = [(4, 384, 1536), (16, 384, 384)]


def ns(G: torch.Tensor) -> torch.Tensor:
    return orthogonalize(G, method="gram", compute_dtype=torch.float32, backend="torch")


def _shape(text: str) -> tuple[int, int, int]:
    try:
        b, m, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not BxMxN, e.g. 4x384x1536") from None
    return b, m, n


def median_seconds(fn, G: torch.Tensor, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn(G)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    out = ROOT / "benchmarks" / "results" / "ns-compile-cpu.json"
    p.add_argument("--out", type=pathlib.Path, default=out)
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="BxMxN",
        help="batches to time (default: 4x384x1536 16x384x384)",
    )
    args = p.parse_args(argv)
    shapes = SHAPES if args.shapes is None else [_shape(s) for s in args.shapes]
    torch.set_num_threads(args.threads)
    rows = {}
    for b, m, n in shapes:
        G = torch.randn(b, m, n, generator=torch.Generator().manual_seed(0))
        compiled = torch.compile(ns)
        t0 = time.perf_counter()
        got = compiled(G)
        first = time.perf_counter() - t0
        want = ns(G)
        eager, comp = median_seconds(ns, G), median_seconds(compiled, G)
        rows[f"{b}x{m}x{n}"] = {
            "eager_s": eager,
            "compiled_s": comp,
            "compiled_over_eager": comp / eager,
            "first_compiled_call_s": first,
            "max_abs_diff": float((got - want).abs().max()),
        }
        print(f"{b} × {m} × {n}: {rows[f'{b}x{m}x{n}']}", flush=True)
    result = {
        "torch": torch.__version__,
        # the shared record: CPU model, native bf16, versions, commit, threads
        "machine": machine_info("cpu"),
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
