"""``dmuon-plan`` against DMuon's published LLM runs (128 × A800, bf16, sequence 4096).

The published table (DMuon repository README, branch ``profiled_ilp``; see
``docs/benchmarks/index.md``) gives the p50 step of FSDP2 + AdamW and of DMuon for
four models in two runtimes. The global batch is not published, so the planner
cannot derive forward + backward from an MFU; instead each row's forward + backward
is set so that the planner's AdamW step equals the published AdamW step (a
measured time: it fixes the compute window FSDP2's and DMuon's traffic hide behind,
the same for both predictions), and the planner predicts what DMuon adds:
Newton–Schulz on the busiest owner and the communication that does not hide. One
device profile for every row (the A800 datasheet, NS at 0.6 of peak), one link
assumption (NVLink 400 GB/s bidirectional inside a node, 400 Gb/s per GPU between
nodes: the cluster's fabric is not published; with 200 Gb/s HDR per GPU, FSDP2's
own AdamW traffic for the 7B and 8B models would take longer than the published
AdamW step, so the fabric is at least NDR-class) and no per-row factor.

``FSDP-Z2`` maps to owner mode, ``HSDP-Z3`` to ``owner-z3`` (the planner has no HSDP
hierarchy: it treats the 128 ranks as one flat group).

Beside the datasheet's assumed 0.6, each row is predicted again with the Newton–Schulz
efficiency measured on a GPU: ``--measured`` names a ``benchmarks/gpu_check.py`` result
(default: the H200 run in ``benchmarks/results``, if present); its median achieved NS
rate over the GPU's peak is carried over to the A800 as a fraction of peak (Hopper
measured, Ampere predicted: a stated assumption, not a measurement of the A800).

    python benchmarks/plan_published.py            # prints the table, writes JSON
    python benchmarks/plan_published.py --out plan-published.json   # the JSON elsewhere
    python benchmarks/plan_published.py --measured benchmarks/results/gpu-check-<gpu>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common.metrics import machine_info
from dmuon.optim.planner.config import load_model
from dmuon.optim.planner.profiles import (
    DEVICES,
    INTERCONNECTS,
    ClusterProfile,
    load_device_profile,
)
from dmuon.optim.planner.step_model import TrainingShape, predict

# model, runtime, AdamW ms, DMuon ms (p50 step-start interval, published)
PUBLISHED = [
    ("qwen2.5-1.5b", "FSDP-Z2", 623, 634),
    ("qwen2.5-1.5b", "HSDP-Z3", 657, 634),
    ("qwen2.5-7b", "FSDP-Z2", 1233, 1229),
    ("qwen2.5-7b", "HSDP-Z3", 1246, 1334),
    ("llama-3.2-3b", "FSDP-Z2", 1168, 1166),
    ("llama-3.2-3b", "HSDP-Z3", 1192, 1165),
    ("llama-3.1-8b", "FSDP-Z2", 1271, 1372),
    ("llama-3.1-8b", "HSDP-Z3", 1348, 1412),
]
MODE = {"FSDP-Z2": "owner", "HSDP-Z3": "owner-z3"}
RESULTS = pathlib.Path(__file__).parent / "results"
OUT = RESULTS / "plan-published-a800.json"
MEASURED = RESULTS / "gpu-check-nvidia-h200.json"


def solve_fwd_bwd(spec, cluster, adamw_s: float) -> float:  # type: ignore[no-untyped-def]
    """Forward + backward for which the predicted AdamW step is ``adamw_s`` (bisection;
    the AdamW step grows with it). Raises when the AdamW traffic alone exceeds it."""
    lo, hi = 0.0, adamw_s

    def step(fb: float) -> float:
        shape = TrainingShape(seq_len=4096, fwd_bwd_s=fb)
        return predict(spec, cluster, shape, modes=()).modes["adamw"].step_s

    if step(hi * 1e-6) > adamw_s:
        raise ValueError(f"{spec.name}: AdamW's predicted communication alone exceeds {adamw_s}")
    for _ in range(50):
        mid = (lo + hi) / 2 or hi * 1e-6
        lo, hi = (mid, hi) if step(mid) < adamw_s else (lo, mid)
    return hi


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--measured",
        type=pathlib.Path,
        default=MEASURED if MEASURED.is_file() else None,
        help="a benchmarks/gpu_check.py result: also predict with its measured NS efficiency",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=OUT,
        help="the JSON file to write (default: benchmarks/results/plan-published-a800.json)",
    )
    args = parser.parse_args(argv)
    cluster = ClusterProfile(
        DEVICES["A800"], 128, 8, INTERCONNECTS["nvlink3-a800"], INTERCONNECTS["ib-ndr"]
    )
    measured = None
    if args.measured is not None:
        gpu = load_device_profile(str(args.measured))
        device = dataclasses.replace(
            DEVICES["A800"],
            ns_efficiency=gpu.ns_efficiency,
            source=f"{DEVICES['A800'].source}; NS efficiency {gpu.ns_efficiency:.2f} "
            f"measured on {gpu.name} ({args.measured.name})",
        )
        measured = dataclasses.replace(cluster, device=device)
        print(f"measured NS efficiency: {gpu.ns_efficiency:.3f} of peak ({args.measured.name})")
    rows = []
    print(
        f"{'model':<14} {'runtime':<8} {'AdamW ms':>9} {'DMuon ms':>9} {'published':>10} "
        f"{'predicted':>10} {'fwd+bwd':>8} {'NS ms':>7} {'exposed ms':>11} {'imbalance':>10}"
        + (f" {'pred. (measured NS)':>20}" if measured is not None else "")
    )
    for model, runtime, adamw_ms, dmuon_ms in PUBLISHED:
        spec = load_model(model)
        mode = MODE[runtime]
        fb = solve_fwd_bwd(spec, cluster, adamw_ms / 1e3)
        shape = TrainingShape(seq_len=4096, fwd_bwd_s=fb)
        p = predict(spec, cluster, shape, modes=(mode,))
        m, a = p.modes[mode], p.modes["adamw"]
        exposed = sum(m.exposed_s.values())
        row = {
            "model": model,
            "runtime": runtime,
            "mode": mode,
            "published_adamw_ms": adamw_ms,
            "published_dmuon_ms": dmuon_ms,
            "published_overhead": dmuon_ms / adamw_ms - 1,
            "predicted_overhead": m.overhead_vs_adamw,
            "predicted_adamw_ms": a.step_s * 1e3,
            "predicted_dmuon_ms": m.step_s * 1e3,
            "fwd_bwd_ms": fb * 1e3,
            "ns_ms": m.ns_s * 1e3,
            "exposed_comm_ms": exposed * 1e3,
            "adamw_exposed_comm_ms": sum(a.exposed_s.values()) * 1e3,
            "imbalance": p.plan.imbalance(),
            "predicted_vanilla_ms": p.modes["vanilla"].step_s * 1e3,
        }
        if measured is not None:
            fb_m = solve_fwd_bwd(spec, measured, adamw_ms / 1e3)
            pm = predict(spec, measured, TrainingShape(seq_len=4096, fwd_bwd_s=fb_m), modes=(mode,))
            row["predicted_overhead_measured_ns"] = pm.modes[mode].overhead_vs_adamw
            row["ns_ms_measured_ns"] = pm.modes[mode].ns_s * 1e3
        rows.append(row)
        print(
            f"{model:<14} {runtime:<8} {adamw_ms:>9} {dmuon_ms:>9} "
            f"{row['published_overhead']:>+10.1%} {row['predicted_overhead']:>+10.1%} "
            f"{fb * 1e3:>8.0f} {row['ns_ms']:>7.1f} {row['exposed_comm_ms']:>11.1f} "
            f"{row['imbalance']:>10.1%}"
            + (f" {row['predicted_overhead_measured_ns']:>+20.1%}" if measured is not None else "")
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {
        # nothing is timed here: the record says which commit and versions predicted
        "machine": machine_info("cpu"),
        "cluster": "128 × A800 (datasheet profile), 8 per node, nvlink3-a800 / ib-ndr",
        "measured_ns_profile": None if measured is None else measured.device.source,
        "assumptions": [{"what": w, "value": v} for w, v in p.assumptions],
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
