"""Expert parallelism: one training iteration of a mixture-of-experts model in each mode.

The model is :mod:`benchmarks.common.moe`'s (``--layers`` blocks, each a router, two
expert stacks of ``--experts`` experts and a dense layer), its stacks ``Shard(0)`` over
``ep``, on two layouts of gloo ranks (one thread each):

==========  ==========================================================================
``ep``      a 1-D ``ep`` mesh over 2 ranks: each rank holds half the experts
``dp×ep``   a ``dp 2 × ep 2`` mesh over 4 ranks: each rank's experts also on its
            ``dp`` replica
==========  ==========================================================================

and, side by side in each, the setups that train it (the same model, batches and
``lr``):

==============  ==============================================================
``adamw``       ``torch.optim.AdamW(foreach=True)``; gradients finished by hand
                as DDP would (dense all-reduced over every rank, experts over
                ``dp``) — the baseline
``single``      ``DMuon(mode="single")``, gradients finished by hand: every
                rank orthogonalises every dense matrix and its own experts
``replicated``  ``DMuon(mode="replicated", process_group=dp)`` (``dp×ep`` only):
                gradients by hand, one owner among the ``dp`` replicas
``owner``       ``ddp.dedicate(model)`` + ``DMuon(distributed=ded)``: no gradient
                code; dense matrices reduced to their owners during backward, each
                expert stack stepped by one owner among its replicas
==============  ==============================================================

Timed per setup: the whole iteration (forward, backward, the gradients' finishing,
``opt.step()``, ``zero_grad``), and ``opt.step()`` alone, medians over the timed
iterations of every rank with their quartiles; rounds interleave the setups. Counted per
rank (independent of the machine): the matrices each rank orthogonalises per step, dense
and expert (a stack of ``E`` experts counts ``E``), the most on any rank. Printed as a
table with ratios to AdamW; ``--out`` gets ``experts-cpu.json`` and ``.png``
(``-quick`` with ``--quick``), with the machine. Four ranks on fewer cores are
oversubscribed: the JSON records the cores and the load average beside the figures.

    python benchmarks/experts.py
    python benchmarks/experts.py --quick --out OUT_DIR   # a tiny run (the test's)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402
from benchmarks.common.moe import MoEModel, expert_parallel, finish_gradients  # noqa: E402

LAYOUTS = {"ep": ((2,), ("ep",)), "dp×ep": ((2, 2), ("dp", "ep"))}
SETUPS = ("adamw", "single", "replicated", "owner")
STACKS = ("w_in", "w_out")
PHASES = ("iteration", "step")


def setups_of(layout: str) -> tuple[str, ...]:
    """The setups that run on ``layout`` (``replicated`` needs data-parallel replicas)."""
    return tuple(s for s in SETUPS if s != "replicated" or layout == "dp×ep")


class _Optimizers:
    """Several optimizers stepped as one (AdamW's foreach over plain tensors and DTensors)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _build(setup: str, mesh: Any, size: dict[str, int], lr: float) -> tuple[Any, Any, bool]:
    """(model, optimizer, whether the gradients are finished by hand)."""
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    dims = {k: size[k] for k in ("d", "hidden", "experts", "layers")}
    model = expert_parallel(MoEModel(d_in=size["d"], d_out=size["d"], **dims, seed=0), mesh)
    options = dict(lr=lr, adamw_lr=lr, ns_compute_dtype=torch.float32)
    if setup == "adamw":  # foreach takes one kind of tensor per call: one per kind
        split = [[p for p in model.parameters() if hasattr(p, "to_local") == d] for d in (0, 1)]
        return (
            model,
            _Optimizers([torch.optim.AdamW(ps, lr=lr, foreach=True) for ps in split]),
            True,
        )
    if setup == "owner":
        ded = ddp.dedicate(model)
        return model, DMuon(param_groups(model), distributed=ded, **options), False
    group = {"process_group": mesh.get_group("dp")} if setup == "replicated" else {}
    return model, DMuon(param_groups(model), mode=setup, **group, **options), True


def _orthogonalised(model: Any, opt: Any) -> dict[str, int]:
    """Matrices this rank orthogonalises per step: dense, and experts (each of a stack)."""
    from dmuon.optim import DMuon

    if not isinstance(opt, DMuon):
        return {"dense": 0, "experts": 0}
    dense = experts = 0
    for group in opt.param_groups:
        if group["rule"] in ("adamw", "lion"):
            continue
        for p in group["params"]:
            if not opt.engine.steps(p):
                continue
            if p.dim() > 2:
                experts += p.to_local().shape[0] if hasattr(p, "to_local") else p.shape[0]
            else:
                dense += 1
    return {"dense": dense, "experts": experts}


def _rank_main(
    rank: int, world: int, layout: str, size: dict[str, int], rounds: int, steps: int
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    built = {s: _build(s, mesh, size, lr=1e-3) for s in setups_of(layout)}
    times: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES} for s in built}
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = size["tokens"]
    for r in range(rounds + 1):  # round 0 warms up (state, plans, caches)
        for setup, (model, opt, by_hand) in built.items():
            for _ in range(steps):
                x = torch.randn(tokens, size["d"], generator=g)
                dist.barrier()
                t0 = time.perf_counter()
                F.mse_loss(model(x), x).backward()
                if by_hand:
                    finish_gradients(model, mesh)
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                if r:
                    times[setup]["iteration"].append(t3 - t0)
                    times[setup]["step"].append(t2 - t1)
    counts = {s: _orthogonalised(model, opt) for s, (model, opt, _) in built.items()}
    return {"times": times, "counts": counts}


def _quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": q[1] * 1e3, "p25": q[0] * 1e3, "p75": q[2] * 1e3}


def measure(size: dict[str, int], rounds: int, steps: int, timeout: float) -> dict[str, Any]:
    """Per layout and setup: quartiles (ms) of each phase over every rank, the matrices
    orthogonalised per rank, the ratios to AdamW."""
    from dmuon.comm.testing import run_on_ranks

    out: dict[str, Any] = {}
    for layout, (shape, _) in LAYOUTS.items():
        world = 1
        for n in shape:
            world *= n
        ranks = run_on_ranks(
            _rank_main,
            world,
            args=(layout, size, rounds, steps),
            timeout=timeout,
            threads_per_rank=1,
        )
        rows: dict[str, Any] = {}
        for setup in setups_of(layout):
            row: dict[str, Any] = {
                phase: _quartiles([t for r in ranks for t in r["times"][setup][phase]])
                for phase in PHASES
            }
            per_rank = [r["counts"][setup] for r in ranks]
            row["orthogonalised_per_rank"] = per_rank
            row["most_orthogonalised"] = max(c["dense"] + c["experts"] for c in per_rank)
            rows[setup] = row
        base = rows["adamw"]["iteration"]["median"]
        for row in rows.values():
            row["iteration_ratio_to_adamw"] = round(row["iteration"]["median"] / base, 3)
        out[layout] = {
            "world": world,
            "mesh": dict(zip(LAYOUTS[layout][1], shape, strict=True)),
            "rows": rows,
        }
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| layout | setup | iteration ms (p25–p75) | opt.step ms | × AdamW | matrices per rank "
        "(most) |",
        "|---|---|---|---|---|---|",
    ]
    for layout, res in result.items():
        for setup, row in res["rows"].items():
            it, st = row["iteration"], row["step"]
            lines.append(
                f"| {layout} | {setup} | {it['median']:.1f} ({it['p25']:.1f}–{it['p75']:.1f}) "
                f"| {st['median']:.1f} | {row['iteration_ratio_to_adamw']:.2f} "
                f"| {row['most_orthogonalised']} |"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(5 * len(result), 3.6), squeeze=False)
    for ax, (layout, res) in zip(axes[0], result.items(), strict=True):
        setups = list(res["rows"])
        medians = [res["rows"][s]["iteration"]["median"] for s in setups]
        errs = [
            [m - res["rows"][s]["iteration"]["p25"] for s, m in zip(setups, medians, strict=True)],
            [res["rows"][s]["iteration"]["p75"] - m for s, m in zip(setups, medians, strict=True)],
        ]
        ax.bar(setups, medians, yerr=errs, capsize=3, color="tab:blue")
        ax.set_title(f"{layout} ({res['world']} ranks)")
        ax.set_ylabel("iteration, ms (median, p25–p75)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128, help="model width (128)")
    parser.add_argument("--hidden", type=int, default=256, help="expert hidden width (256)")
    parser.add_argument("--experts", type=int, default=8, help="experts per stack (8)")
    parser.add_argument("--layers", type=int, default=2, help="MoE blocks (2)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank (64)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (3)")
    parser.add_argument("--steps", type=int, default=3, help="iterations per round (3)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the ranks")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for JSON, PNG")
    args = parser.parse_args(argv)
    size = dict(d=args.d, hidden=args.hidden, experts=args.experts, layers=args.layers)
    size["tokens"] = args.tokens
    rounds, steps = args.rounds, args.steps
    if args.quick:
        size = dict(d=8, hidden=16, experts=4, layers=2, tokens=8)
        rounds, steps = 1, 2
    print(f"MoE {size} on {', '.join(LAYOUTS)} ...", flush=True)
    result = measure(size, rounds, steps, args.timeout)
    print(table(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = "experts-cpu" + ("-quick" if args.quick else "")
        # each layout's world is in its own entry; every rank runs one thread
        machine = {
            **machine_info(threads_per_rank=1),
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
        payload = {"machine": machine, "size": size, "rounds": rounds, "steps": steps}
        payload["layouts"] = result
        (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
        title = f"MoE {size}, {machine['cpu']}, {machine['cores']} cores"
        plot(result, args.out / f"{stem}.png", title)
        print(f"wrote {args.out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
