"""Ahead-of-time compile of the Triton symmetric kernel for sm80 and sm90, without a GPU.

Compiles every config the autotuner may pick on A100 (sm80) and H100/H200 (sm90),
for fp16, bf16 and fp32 (IEEE and TF32 products) and both launch variants (``syrk``,
``sym_poly``), with Triton's bundled ``ptxas`` (:mod:`dmuon.kernels.triton.aot`).
Prints a table and writes ``benchmarks/results/triton-compile.json``: registers per
thread, spill bytes, stack and shared memory against the target's limit, per config.
Nothing is timed; the test ``packages/dmuon-kernels/tests/test_triton_compile.py``
drives the same function and fails on a config that does not compile or fit.

    python benchmarks/triton_compile.py            # a few minutes on 2 cores
    python benchmarks/triton_compile.py --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # the kernel must be defined for compilation

from benchmarks.common.metrics import machine_info  # noqa: E402
from dmuon.kernels.triton.aot import compile_candidates  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="compile processes")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "triton-compile.json")
    args = parser.parse_args(argv)
    import triton

    start = time.perf_counter()
    records = compile_candidates(args.workers)
    seconds = time.perf_counter() - start
    header = f"{'sm':>4} {'dtype':>9} {'variant':>8} {'config':>16} {'regs':>5} {'spill':>6} "
    print(header + f"{'shared KiB':>10} {'limit':>6}")
    failed = 0
    for r in records:
        cc = f"{r['capability'][0]}{r['capability'][1]}"
        dtype = r["dtype"] + ("/tf32" if r["precision"] == "tf32" else "")
        cfg = "×".join(map(str, r["config"][:2])) + f" w{r['config'][2]} s{r['config'][3]}"
        if "error" in r:
            failed += 1
            print(f"{cc:>4} {dtype:>9} {r['variant']:>8} {cfg:>16}  FAILED: {r['error'][:80]}")
            continue
        over = " OVER" if r["shared"] > r["shared_limit"] else ""
        print(
            f"{cc:>4} {dtype:>9} {r['variant']:>8} {cfg:>16} {r['registers']:>5} "
            f"{r['spill_stores']:>6} {r['shared'] / 1024:>10.0f} {r['shared_limit'] / 1024:>6.0f}"
            + over
        )
    payload = {
        "meta": {
            **machine_info(),
            "triton": triton.__version__,
            "compile_seconds": round(seconds, 1),
            "note": "compiled on a CPU-only machine with Triton's bundled ptxas; nothing timed",
        },
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(records)} compiles, {failed} failed, {seconds:.0f} s -> {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
