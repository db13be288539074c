"""Tensor-parallel Newton–Schulz: Gram on the shards vs gather + Gram on the whole matrix.

For a matrix split by columns over ``t`` tensor-parallel ranks, per rank:

* **TP-native Gram** (:func:`dmuon.kernels.tp_gram_newton_schulz`): every rank runs
  the iteration on its own ``m × n/t`` shard; the ``m × m`` work is repeated on every
  rank, the ``m × n`` products are divided by ``t``. It moves ``(restarts + 1)``
  all-reduces of the ``m × m`` Gram matrix.
* **Gather + Gram**: one all-gather of the shards, then every rank runs
  :func:`dmuon.kernels.gram_newton_schulz` on the whole matrix and keeps its shard
  (the library's gather path, ``tp_path="gather"``).

One process measures the compute of one rank: the TP-native time is that of one
shard's iteration with the group's sum left out (the shapes, and so the FLOPs, are
those of a real rank), the gather time is the whole-matrix call. The bytes are those
the library's own α–β model says each rank sends
(:func:`dmuon.comm.tensor_parallel_path`'s ``gram_bytes`` and ``gather_bytes``, what
``tp_path="auto"`` prices): a ring all-reduce sends ``2 (t − 1)/t`` of its payload per
rank, an all-gather ``(t − 1)/t`` of the whole matrix; the Gram matrices travel in the
compute dtype, the shards in their own (fp32 here). The time of the collectives is not
included (see ``benchmarks/comm.py`` for the fitted α, β of a backend).

    python benchmarks/tp_gram.py                 # CUDA if present: 4096×14336 split 2, 4
    python benchmarks/tp_gram.py --device cpu    # CPU: 1024×3584 split 2, 4
    python benchmarks/tp_gram.py --dry-run       # toy shapes (benchmarks/gpu_run.py --dry-run)
    python benchmarks/tp_gram.py --device cuda --bytes-only   # the bytes column alone, no GPU

Writes ``benchmarks/results/tp-gram-<device>.json`` and ``.png`` and prints a table.
Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402
from benchmarks.kernels import timeit as median_time  # noqa: E402
from dmuon.comm import tensor_parallel_path  # noqa: E402
from dmuon.kernels import default_compute_dtype, gram_newton_schulz, tp_gram_newton_schulz  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
# (label, m, n): the Gram side m is the short, unsplit one; n is split over the TP ranks.
CUDA_CASES = [("llama-8B mlp 4096x14336", 4096, 14336), ("llama-8B attn 4096x4096", 4096, 4096)]
CPU_CASES = [("llama mlp /4 1024x3584", 1024, 3584), ("gpt2 mlp 768x3072", 768, 3072)]
DRY_RUN_CASES = [("toy 32x96", 32, 96)]
DEGREES = (2, 4)


def _identity(tensor: torch.Tensor, op: str) -> torch.Tensor:
    return tensor


def timeit(fn, min_run_time: float, device: str) -> float:
    """kernels.py's median timing, after one warm-up call (autotune, first allocations)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return median_time(fn, min_run_time)


def bytes_per_rank(
    m: int, n: int, t: int, *, gram_element_size: int, shard_element_size: int
) -> dict[str, int]:
    """Bytes one rank sends on each path, from the library's own model
    (:func:`dmuon.comm.tensor_parallel_path`, columns split over ``t`` ranks), so that
    this table and ``tp_path="auto"`` count the same traffic: the Gram path's
    ``(restarts + 1)`` ring all-reduces of the ``m × m`` Gram matrix (each rank sends
    ``2 (t − 1)/t`` of it) plus the two small normalisation all-reduces, the gather
    path's one all-gather (each rank sends ``(t − 1)/t`` of the whole matrix)."""
    path = tensor_parallel_path(
        m,
        n,
        -1,
        t,
        gram_element_size=gram_element_size,
        gather_element_size=shard_element_size,
    )
    return {"native_bytes": round(path.gram_bytes), "gather_bytes": round(path.gather_bytes)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    cases = cases_of(device, args.dry_run)
    min_run = 0.01 if args.dry_run else args.min_run_time
    dtype = default_compute_dtype(torch.device(device), "gram")
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for label, m, n in cases:
        G = torch.randn(m, n, device=device)
        whole = timeit(lambda G=G: gram_newton_schulz(G, compute_dtype=dtype), min_run, device)
        for t in DEGREES:
            shard = G.tensor_split(t, dim=-1)[0].contiguous()

            def one_rank(shard=shard):
                # restarts as on a real rank: the group's split size is n, not n/t
                return tp_gram_newton_schulz(
                    shard, split_dim=-1, reduce=_identity, compute_dtype=dtype, restarts=(2,)
                )

            native = timeit(one_rank, min_run, device)
            cost = bytes_per_rank(
                m, n, t, gram_element_size=elem, shard_element_size=G.element_size()
            )
            rows.append(
                {
                    "case": label,
                    "m": m,
                    "n": n,
                    "tp": t,
                    "dtype": str(dtype).removeprefix("torch."),
                    "native_ms": native * 1e3,
                    "gather_ms": whole * 1e3,
                    "speedup": whole / native,
                    "native_bytes": cost["native_bytes"],
                    "gather_bytes": cost["gather_bytes"],
                    "shard_dtype": str(G.dtype).removeprefix("torch."),
                }
            )
    return {"meta": machine_info(device), "rows": rows, "dry_run": args.dry_run}


def cases_of(device: str, dry_run: bool) -> list[tuple[str, int, int]]:
    return DRY_RUN_CASES if dry_run else (CUDA_CASES if device == "cuda" else CPU_CASES)


def print_bytes(device: str, dry_run: bool) -> None:
    """The "MB sent per rank" figures of :func:`run` for ``device``'s shapes, without a
    device: the model is analytic (Gram in the device's compute dtype, fp32 shards)."""
    elem = torch.empty((), dtype=default_compute_dtype(torch.device(device), "gram")).element_size()
    print("case  TP  MB sent per rank: TP-native / gather")
    for label, m, n in cases_of(device, dry_run):
        for t in DEGREES:
            b = bytes_per_rank(m, n, t, gram_element_size=elem, shard_element_size=4)
            print(f"{label}  {t}  {b['native_bytes'] / 1e6:.1f} / {b['gather_bytes'] / 1e6:.1f}")


def print_table(result: dict[str, Any]) -> None:
    header = [
        "case",
        "TP",
        "dtype",
        "TP-native ms",
        "gather ms",
        "speed-up",
        "MB sent/rank native/gather",
    ]
    lines = [header]
    for r in result["rows"]:
        lines.append(
            [
                r["case"],
                str(r["tp"]),
                r["dtype"],
                f"{r['native_ms']:.2f}",
                f"{r['gather_ms']:.2f}",
                f"{r['speedup']:.2f}x",
                f"{r['native_bytes'] / 1e6:.1f} / {r['gather_bytes'] / 1e6:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    for row in lines:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def plot(result: dict[str, Any], path: pathlib.Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['case']}\nTP {r['tp']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["gather_ms"] for r in rows], 0.4, label="gather + Gram")
    ax.bar([i + 0.2 for i in x], [r["native_ms"] for r in rows], 0.4, label="TP-native Gram")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("compute per rank (ms)")
    ax.set_title(f"Newton–Schulz of a TP matrix ({result['meta']['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="toy shapes (checks the code)")
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds per measurement")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--no-plot", action="store_true", help="JSON only (gpu_run.py's file limit)")
    p.add_argument(
        "--bytes-only",
        action="store_true",
        help="print the bytes each rank sends for the device's shapes, time nothing, "
        "write nothing (the model's figures need no GPU)",
    )
    args = p.parse_args(argv)
    if args.bytes_only:
        print_bytes(args.device, args.dry_run)
        return 0
    torch.manual_seed(0)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"tp-gram-{args.device}" + ("-dry-run" if args.dry_run else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plotted = not args.no_plot and plot(result, args.out / f"{stem}.png")
    print_table(result)
    print(f"wrote {args.out / (stem + '.json')}" + (" and .png" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
