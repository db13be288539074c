"""The owner step's non-finite check: every gradient read, or only those no launch vouched for.

In owner mode each layer's launch copies its gradients into the reduction buckets
during backward and takes one fp32 sum per bucket there
(:meth:`dmuon.optim.engine.reduction.Reduction.finite_at_launch`): a finite sum proves
every entry finite, so the step's agreement reads only the gradients no launch vouched
for. This script times both forms of the check side by side, on the same gradients of
the same run: 2 gloo ranks, ``ddp.dedicate`` on ``L`` tiny layers (the model of
``benchmarks/step_overhead.py``: a ``width × width`` linear layer with its bias and a
LayerNorm, 4 parameters a layer), after each backward

``all``       ``_nonfinite_names(engine)``: every gradient read (the form before)
``vouched``   ``_nonfinite_names(engine, reduction.finite_at_launch())``: the step's form

alternated ``--repeats`` times per backward, medians over ranks and iterations. Prints
a table; ``--out`` gets ``nonfinite-check-cpu.json`` with the machine.

    python benchmarks/nonfinite_check.py                 # depths 32 128
    python benchmarks/nonfinite_check.py --depths 8 --iterations 3 --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402

WORLD = 2  # gloo ranks, one torch thread each

FORMS = ("all", "vouched")


def _rank_main(
    rank: int, world: int, depths: Sequence[int], width: int, iterations: int, repeats: int
) -> dict[int, dict[str, list[float]]]:
    from benchmarks.step_overhead import Stack
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups
    from dmuon.optim.engine.guards import _nonfinite_names

    out: dict[int, dict[str, list[float]]] = {}
    for depth in depths:
        torch.manual_seed(0)
        model = Stack(depth, width)
        opt = DMuon(param_groups(model), distributed=ddp.dedicate(model))
        reduction = opt.engine.exchange.reduction  # type: ignore[attr-defined]
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
        times: dict[str, list[float]] = {form: [] for form in FORMS}
        for i in range(iterations + 1):  # the first is a warm-up
            model(x).square().mean().backward()
            for _ in range(repeats):
                t0 = time.perf_counter()
                everything = _nonfinite_names(opt.engine)
                t1 = time.perf_counter()
                vouched = _nonfinite_names(opt.engine, reduction.finite_at_launch())
                t2 = time.perf_counter()
                if everything != vouched:  # the same answer, or the figures mean nothing
                    raise AssertionError(f"L={depth}: {everything} != {vouched}")
                if i:
                    times["all"].append(t1 - t0)
                    times["vouched"].append(t2 - t1)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[depth] = times
    return out


def measure(
    depths: Sequence[int], width: int, iterations: int, repeats: int, timeout: float
) -> dict[str, Any]:
    """Median µs of each form per depth, over both ranks."""
    from dmuon.comm.testing import run_on_ranks

    per_rank = run_on_ranks(
        _rank_main,
        WORLD,
        args=(tuple(depths), width, iterations, repeats),
        timeout=timeout,
        threads_per_rank=1,
    )
    rows = {}
    for depth in depths:
        row = {
            form: statistics.median(t for r in per_rank for t in r[depth][form]) * 1e6
            for form in FORMS
        }
        rows[str(depth)] = {
            "params": 4 * depth,
            "all_us": round(row["all"], 1),
            "vouched_us": round(row["vouched"], 1),
            "ratio": round(row["vouched"] / row["all"], 3),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[32, 128], help="layers")
    parser.add_argument("--width", type=int, default=16, help="matrix size (16)")
    parser.add_argument("--iterations", type=int, default=20, help="timed backwards (20)")
    parser.add_argument("--repeats", type=int, default=5, help="checks per backward (5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the ranks")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.depths, args.width, args.iterations, args.repeats, args.timeout)
    print("| L | parameters | every gradient read, µs | vouched ones skipped, µs | ratio |")
    print("|---|---|---|---|---|")
    for depth, r in rows.items():
        print(
            f"| {depth} | {r['params']} | {r['all_us']:.1f} | {r['vouched_us']:.1f} "
            f"| {r['ratio']:.2f} |"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "nonfinite-check-cpu.json"
        machine = {
            **machine_info(world_size=WORLD, threads_per_rank=1),
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
        result = {"machine": machine, "width": args.width, "rows": rows}
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
