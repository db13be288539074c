"""Predicted vs measured: ``dmuon-plan``'s step model against ``benchmarks/step.py --world N``.

One run, one machine: the device profile is calibrated first (GEMM, Newton–Schulz on
the benchmark model's shapes, AdamW, and an all-reduce α–β fit on ``N`` gloo ranks,
one thread per rank as the step benchmark uses), the forward + backward of one
rank's micro-batch is timed on one process (the input ``--fwd-bwd-ms`` would give),
then the step benchmark runs its setups on ``N`` ranks and every setup is compared
with the planner's prediction for the matching mode:

===================  ===================
step.py setup        planner mode
===================  ===================
``adamw_ddp``        ``adamw-ddp``
``adamw_fsdp``       ``adamw``
``muon_vanilla``     ``vanilla-ddp``
``owner_fsdp``       ``owner``
``owner_ddp``        ``owner-ddp``
``owner_ddp_zero1``  ``owner-ddp-zero1``
``replicated``       ``replicated``
``sharded``          ``sharded``
``sign``             ``sign``
===================  ===================

Printed per setup: predicted and measured step, optimizer step and communication
wait, with the relative error, and whether the planner orders the setups as the
measurement does; and the memory per rank the planner predicts (weights, gradients,
optimizer state, buffers) beside what the busiest rank holds at the end of its last
backward, counted from the tensors (``benchmarks/step.py``'s ``memory_bytes_per_rank``; the
prediction also counts FSDP2's transient unsharded layer, which is freed by then).
Writes ``benchmarks/results/plan-check-cpu.json`` and ``.png`` (``--quick``:
``plan-check-cpu-quick``, so that a quick run never replaces the full one).
Timings on a shared machine are perturbed by its load; the JSON records the load
average and the machine. Nothing here asserts on time.

    python benchmarks/plan_check.py                # worlds 2 and 4
    python benchmarks/plan_check.py --quick        # the small model, few steps
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import step_world
from benchmarks.common.metrics import machine_info
from benchmarks.common.model import GPT
from dmuon.optim.planner.calibrate import calibrate, fit_link
from dmuon.optim.planner.config import spec_from_module
from dmuon.optim.planner.profiles import ClusterProfile, Link
from dmuon.optim.planner.step_model import TrainingShape, predict

SETUP_MODE = {
    "adamw_ddp": "adamw-ddp",
    "adamw_fsdp": "adamw",
    "muon_vanilla": "vanilla-ddp",
    "owner_fsdp": "owner",
    "owner_ddp": "owner-ddp",
    "owner_ddp_zero1": "owner-ddp-zero1",
    "replicated": "replicated",
    "sharded": "sharded",
    "sign": "sign",
}
RESULTS = pathlib.Path(__file__).parent / "results"
MEMORY_KINDS = ("weights", "gradients", "optimizer_state", "buffers")


def time_fwd_bwd(cfg: step_world.WorldConfig, repeats: int = 5) -> float:
    """Median seconds of one rank's forward + backward, one process, one thread."""
    model = GPT(cfg.gpt())
    x = torch.randint(0, 256, (cfg.batch_per_rank, cfg.seq_len))
    times = []
    for k in range(repeats + 2):
        t0 = time.perf_counter()
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        model.zero_grad(set_to_none=True)
        if k >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _calibrate_rank(rank: int, world: int, cfg: step_world.WorldConfig) -> dict[str, Any]:
    """Inside each of ``world`` concurrent ranks (one thread each, as the benchmark's):
    the device profile and one rank's forward + backward, under the same sharing of
    the CPU cores as the step benchmark."""
    spec = spec_from_module(GPT(cfg.gpt()), "benchmark GPT")
    profile = calibrate(spec, device="cpu", dtype=torch.float32, link_world=0)
    return {"profile": profile.to_json(), "fwd_bwd_s": time_fwd_bwd(cfg)}


def calibrate_concurrently(world: int, cfg: step_world.WorldConfig) -> tuple[Any, float]:
    """The slowest rank's profile and forward + backward (the step waits for it)."""
    from dmuon.comm.testing import run_on_ranks
    from dmuon.optim.planner.profiles import DeviceProfile

    out = run_on_ranks(_calibrate_rank, world, args=(cfg,), timeout=900, threads_per_rank=1)
    slowest = min(out, key=lambda r: r["profile"]["measured"]["ns_flops_per_second"])
    return DeviceProfile(**slowest["profile"]), max(r["fwd_bwd_s"] for r in out)


def compare(measured: dict[str, Any], pred: Any) -> dict[str, Any]:
    rows = {}
    for setup, mode in SETUP_MODE.items():
        if setup not in measured:
            continue
        m = measured[setup]
        p = pred.modes[mode]
        # owner mode's reductions wait in backward (ddp.dedicate's all-reduce of the
        # scalars, or their reductions to their owners, too); the other modes' in the step
        owner = mode in ("owner", "owner-ddp", "owner-ddp-zero1")
        wait = p.exposed_s["backward"] if owner else p.exposed_s["step"]
        got = {"step": m["total"], "optimizer": m["seconds"]["optimizer"],
               "comm_wait": m["seconds"]["comm_wait"]}  # fmt: skip
        want = {"step": p.step_s, "optimizer": p.optimizer_s, "comm_wait": wait}
        rows[setup] = {
            "mode": mode,
            "measured_s": got,
            "predicted_s": want,
            "relative_error": {
                k: (want[k] / got[k] - 1) if got[k] > 0 else None for k in ("step", "optimizer")
            },
        }
        held = [r for r in m.get("memory_bytes_per_rank", []) if r]
        if held:  # the busiest rank's bytes of each kind, as the planner reports them
            rows[setup]["memory_bytes"] = {
                "measured": {k: max(r[k] for r in held) for k in (*MEMORY_KINDS, "total")},
                "predicted": {k: p.memory[k] for k in (*MEMORY_KINDS, "total")},
                "peak_rss_per_rank": m.get("peak_rss_bytes_per_rank"),
            }
    order_m = sorted(rows, key=lambda s: rows[s]["measured_s"]["step"])
    order_p = sorted(rows, key=lambda s: rows[s]["predicted_s"]["step"])
    return {"rows": rows, "order_measured": order_m, "order_predicted": order_p}


def print_world(world: int, result: dict[str, Any]) -> None:
    print(f"\nworld {world} (gloo, 1 thread per rank)")
    head = f"{'setup':<16} {'mode':<16} {'step pred/meas ms':>20} {'err':>7} "
    head += f"{'opt pred/meas ms':>19} {'err':>7} {'wait pred/meas ms':>19}"
    print(head)
    for setup, r in result["rows"].items():
        p, m, e = r["predicted_s"], r["measured_s"], r["relative_error"]
        err = lambda x: "-" if x is None else f"{x:+.0%}"  # noqa: E731
        print(
            f"{setup:<16} {r['mode']:<16} {p['step'] * 1e3:9.1f}/{m['step'] * 1e3:<9.1f} "
            f"{err(e['step']):>7} {p['optimizer'] * 1e3:8.1f}/{m['optimizer'] * 1e3:<9.1f} "
            f"{err(e['optimizer']):>7} {p['comm_wait'] * 1e3:8.1f}/{m['comm_wait'] * 1e3:<9.1f}"
        )
    print(f"\n{'setup':<16} memory per rank, MB predicted/measured (end of the last backward): "
          + "  ".join(f"{k}" for k in (*MEMORY_KINDS, "total")))  # fmt: skip
    for setup, r in result["rows"].items():
        mem = r.get("memory_bytes")
        if mem:
            cells = [f"{mem['predicted'][k] / 1e6:7.1f}/{mem['measured'][k] / 1e6:<7.1f}"
                     for k in (*MEMORY_KINDS, "total")]  # fmt: skip
            print(f"{setup:<16} " + "  ".join(cells))
    same = result["order_measured"] == result["order_predicted"]
    print(f"order by measured step:  {', '.join(result['order_measured'])}")
    print(f"order by predicted step: {', '.join(result['order_predicted'])}"
          + ("  (same)" if same else "  (differs)"))  # fmt: skip


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = result["worlds"]
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
    for ax, (world, w) in zip(axes[0], worlds.items(), strict=True):
        names = list(w["rows"])
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [w["rows"][n]["measured_s"]["step"] * 1e3 for n in names],
               0.4, label="measured")  # fmt: skip
        ax.bar([x + 0.2 for x in xs], [w["rows"][n]["predicted_s"]["step"] * 1e3 for n in names],
               0.4, label="predicted")  # fmt: skip
        ax.set_xticks(list(xs), names, rotation=30, ha="right")
        ax.set_ylabel("step (ms)")
        ax.set_title(f"world {world}, gloo on CPU")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the small model")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--out", default=None, help="default: results/plan-check-cpu[-quick]")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(RESULTS / ("plan-check-cpu-quick" if args.quick else "plan-check-cpu"))
    cfg = step_world.QUICK if args.quick else step_world.WorldConfig()
    torch.set_num_threads(1)  # as each rank of the step benchmark
    spec = spec_from_module(GPT(cfg.gpt()), "benchmark GPT")
    out: dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "worlds": {},
        "meta": machine_info("cpu"),
        "caveat": "timings on a shared 2-core machine; other processes perturb them",
    }
    for world in args.worlds:
        print(f"calibrating on {world} concurrent ranks ({spec.total_params:,} parameters)",
              flush=True)  # fmt: skip
        profile, fb = calibrate_concurrently(world, cfg)
        print(f"  NS {profile.ns_flops_per_second / 1e9:.1f} GFLOP/s, call overhead "
              f"{profile.call_overhead * 1e6:.0f} µs, optimizer overhead "
              f"{profile.matrix_overhead * 1e6:.0f} µs/matrix, AdamW "
              f"{profile.bytes_per_second / 1e9:.1f} GB/s, fwd+bwd {fb * 1e3:.1f} ms",
              flush=True)  # fmt: skip
        link = fit_link(world)
        print(f"  all-reduce on {world} ranks: α {link['alpha'] * 1e6:.0f} µs, "
              f"{link['bandwidth'] / 1e9:.2f} GB/s; majority vote "
              f"{link['vote_seconds_per_element'] * 1e9:.2f} ns/element beyond its transfers; "
              f"Sign-Muon {profile.sign_overhead * 1e6:.0f} µs/matrix beyond Muon",
              flush=True)  # fmt: skip
        profile = dataclasses.replace(profile, vote_overhead=link["vote_seconds_per_element"])
        measured_link = Link.from_fit(link)
        cluster = ClusterProfile(profile, world, world, measured_link, measured_link)
        shape = TrainingShape(
            global_tokens=world * cfg.batch_per_rank * cfg.seq_len,
            seq_len=cfg.seq_len,
            fwd_bwd_s=fb,
        )
        pred = predict(spec, cluster, shape, modes=tuple(SETUP_MODE.values()))
        print(f"running benchmarks/step.py --world {world} ...", flush=True)
        measured = step_world.run_world(
            world, setups=list(SETUP_MODE), cfg=cfg, steps=args.steps, warmup=args.warmup,
            device="cpu", timeout=args.timeout,
        )  # fmt: skip
        result = compare(measured["rows"], pred)
        result["link"] = link
        result["profile"] = profile.to_json()
        result["fwd_bwd_s"] = fb
        result["load_average_1min"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        out["worlds"][str(world)] = result
        print_world(world, result)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    plot(out, path.with_suffix(".png"))
    print(f"\nwrote {path.with_suffix('.json')} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
