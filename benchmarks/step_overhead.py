"""The host cost of one optimizer step against the number of parameters.

On a GPU the step of a model of many parameters is bound by the host: every Python
call per parameter and step costs microseconds, while ``torch.optim.AdamW(foreach=True)``
makes a handful of calls per dtype group. This benchmark measures that cost where the
math is negligible: a model of ``L`` layers, each a tiny ``width × width`` linear layer
with its bias and a LayerNorm (4 parameters a layer, one of them a matrix, so
Newton–Schulz costs little), for ``L`` in ``--depths``. In one run, side by side:

``sgd``             ``torch.optim.SGD(foreach=True)``, no momentum: one foreach call, the floor
``adamw``           ``torch.optim.AdamW(foreach=True)``
``dmuon``           ``DMuon(mode="single")``, the default rule (Muon, 5 Newton–Schulz steps)
``dmuon_ns1``       the same with ``ns_steps=1``: the little math left shows what is overhead
``adamw_ddp``       2 gloo ranks: ``DistributedDataParallel`` + AdamW foreach
``dmuon_owner``     2 gloo ranks: ``dmuon.integrations.ddp.dedicate`` + DMuon (owner mode)
``adamw_fsdp``      2 gloo ranks: FSDP2 ``fully_shard`` per layer + AdamW foreach
``dmuon_sharded``   2 gloo ranks: the same FSDP2 model + ``DMuon(mode="sharded")``, whose
                    small layers are packed into units (``layer_pack_mb``, 1 MiB)
``dmuon_sharded_unpacked`` the same with ``layer_pack_mb=0``: two all-to-alls per layer

The single-process setups time ``opt.step()`` alone on fixed gradients; the two-rank
setups time forward, backward (with DDP's or the dedication's hooks) and
``opt.step()`` of whole iterations, and ``bare`` times forward and backward of the same
model without hooks, so the hooks' cost is ``backward − bare backward``. Setups are
interleaved round by round (a shared machine's load hits all alike); each figure is a
median over every timed step of every round, with its quartiles. Printed: µs per step
and per parameter per step at each depth, the slope (least squares over the depths: µs
each added parameter adds) and the ratio to AdamW. ``--out`` gets
``step-overhead-<device>.json`` (``-quick`` with ``--quick``) with the machine (CPU model,
native bf16, torch, threads, load average) and a PNG of µs per parameter against ``L``.

With ``--device cuda`` the single-process setups run on the GPU (the two-rank ones are
left out: they need one GPU per rank), each timed step ends with
``torch.cuda.synchronize()`` (so a figure is the host's or the device's time, whichever is
longer), and ``adamw_fused`` (``torch.optim.AdamW(fused=True)``) joins them; the file is
``step-overhead-cuda.json``. This is where the host cost matters: the GPU's math for
these tiny matrices is a few µs.

    python benchmarks/step_overhead.py                      # depths 8 32 128
    python benchmarks/step_overhead.py --quick --out OUT_DIR   # a tiny run (the test's)
    python benchmarks/step_overhead.py --device cuda        # on a GPU (benchmarks/gpu_run.py)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402

SINGLE_SETUPS = ("sgd", "adamw", "dmuon", "dmuon_ns1")
WORLD_SETUPS = (
    "bare",
    "adamw_ddp",
    "dmuon_owner",
    "adamw_fsdp",
    "dmuon_sharded",
    "dmuon_sharded_unpacked",
)
PHASES = ("forward", "backward", "step")
DEPTHS = (8, 32, 128)
REFERENCE = "adamw"  # what the single-process ratios are taken to
WORLD_REFERENCE = "adamw_ddp"


class Block(nn.Module):
    """One layer: a linear map with bias, then a LayerNorm (4 parameters, 1 matrix)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.linear(x)))


class Stack(nn.Module):
    """``depth`` blocks in a ``ModuleList`` (``blocks.<i>``: one layer each for DMuon)."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def params_of(depth: int) -> int:
    """Parameters of a :class:`Stack` of ``depth`` layers.

    Examples:
        >>> params_of(8)
        32
    """
    return 4 * depth


def single_setups(device: str) -> tuple[str, ...]:
    """The single-process setups on ``device``: fused AdamW too on a GPU.

    Examples:
        >>> single_setups("cpu")
        ('sgd', 'adamw', 'dmuon', 'dmuon_ns1')
    """
    return SINGLE_SETUPS + (("adamw_fused",) if device == "cuda" else ())


def _optimizer(setup: str, model: nn.Module) -> Any:
    from dmuon.optim import DMuon, param_groups

    if setup == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if setup == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    if setup == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if setup == "dmuon":
        return DMuon(param_groups(model), mode="single")
    if setup == "dmuon_ns1":
        return DMuon(param_groups(model), mode="single", ns_steps=1)
    raise ValueError(f"unknown setup {setup!r}; expected one of {SINGLE_SETUPS}")


def _quartiles(samples: Sequence[float]) -> dict[str, float]:
    """Median and quartiles, in µs, of samples in seconds."""
    us = sorted(s * 1e6 for s in samples)
    if len(us) == 1:
        return {"median": us[0], "p25": us[0], "p75": us[0]}
    q = statistics.quantiles(us, n=4, method="inclusive")
    return {"median": statistics.median(us), "p25": q[0], "p75": q[2]}


def run_single(
    depths: Sequence[int],
    width: int,
    rounds: int,
    repeats: int,
    warmup: int,
    device: str = "cpu",
) -> dict[str, dict[int, dict[str, float]]]:
    """``opt.step()`` of every single-process setup: setup → depth → µs quartiles (on a
    GPU each step is synchronised before its clock stops)."""
    setups = single_setups(device)
    samples: dict[str, dict[int, list[float]]] = {s: {d: [] for d in depths} for s in setups}
    built: dict[tuple[str, int], Any] = {}

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for depth in depths:
        for setup in setups:
            torch.manual_seed(0)
            model = Stack(depth, width).to(device)
            x = torch.randn(4, width, device=device)
            model(x).square().mean().backward()  # fixed gradients
            opt = _optimizer(setup, model)
            for _ in range(warmup):
                opt.step()
            built[setup, depth] = (model, opt)
    for _ in range(rounds):
        for depth in depths:
            for setup in setups:
                _, opt = built[setup, depth]
                for _ in range(repeats):
                    sync()
                    t0 = time.perf_counter()
                    opt.step()
                    sync()
                    samples[setup][depth].append(time.perf_counter() - t0)
    return {s: {d: _quartiles(v) for d, v in by.items()} for s, by in samples.items()}


def _rank_main(
    rank: int, world: int, depths: Sequence[int], width: int, rounds: int, repeats: int, warmup: int
) -> dict[str, dict[int, dict[str, list[float]]]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    mesh = init_device_mesh("cpu", (world,))
    built: dict[tuple[str, int], tuple[Callable[..., Any], Any]] = {}
    for depth in depths:
        for setup in WORLD_SETUPS:
            torch.manual_seed(0)
            model = Stack(depth, width)
            if setup == "bare":
                built[setup, depth] = (model, None)
            elif setup == "adamw_ddp":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
                built[setup, depth] = (DDP(model), opt)
            elif setup == "dmuon_owner":
                ded = ddp.dedicate(model)
                built[setup, depth] = (model, DMuon(param_groups(model), distributed=ded))
            else:  # FSDP2, one unit per layer, as torchtitan wraps its blocks
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                if setup == "adamw_fsdp":
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
                else:
                    pack = {"layer_pack_mb": 0} if setup.endswith("_unpacked") else {}
                    opt = DMuon(param_groups(model), mode="sharded", **pack)
                built[setup, depth] = (model, opt)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    samples: dict[str, dict[int, dict[str, list[float]]]] = {
        s: {d: {p: [] for p in PHASES} for d in depths} for s in WORLD_SETUPS
    }

    def iteration(setup: str, depth: int, keep: bool) -> None:
        forward, opt = built[setup, depth]
        t0 = time.perf_counter()
        loss = forward(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if opt is not None:
            opt.step()
        t3 = time.perf_counter()
        if opt is not None:
            opt.zero_grad()
        else:
            forward.zero_grad()
        if keep:
            times = samples[setup][depth]
            times["forward"].append(t1 - t0)
            times["backward"].append(t2 - t1)
            times["step"].append(t3 - t2)

    for depth in depths:
        for setup in WORLD_SETUPS:
            for _ in range(warmup):
                iteration(setup, depth, keep=False)
    for _ in range(rounds):
        for depth in depths:
            for setup in WORLD_SETUPS:
                dist.barrier()  # every rank starts the setup together
                for _ in range(repeats):
                    iteration(setup, depth, keep=True)
    return samples


def run_world(
    depths: Sequence[int],
    width: int,
    rounds: int,
    repeats: int,
    warmup: int,
    world: int,
    timeout: float,
) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Forward, backward and step of the two-rank setups: setup → depth → phase → µs
    quartiles, over the steps of every rank (the ranks wait for each other in the
    collectives)."""
    from dmuon.comm.testing import run_on_ranks

    per_rank = run_on_ranks(
        _rank_main,
        world,
        args=(tuple(depths), width, rounds, repeats, warmup),
        timeout=timeout,
        threads_per_rank=1,
    )
    return {
        s: {
            d: {p: _quartiles([t for r in per_rank for t in r[s][d][p]]) for p in PHASES}
            for d in depths
        }
        for s in WORLD_SETUPS
    }


def slope(depths: Sequence[int], micros: Sequence[float]) -> float:
    """µs each added parameter adds: the least-squares slope of ``micros`` against the
    parameter count (4 a layer).

    Examples:
        >>> slope([8, 32], [100.0, 196.0])
        1.0
    """
    xs = [float(params_of(d)) for d in depths]
    mx, my = statistics.fmean(xs), statistics.fmean(micros)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, micros, strict=True)) / sxx


def summarise(
    depths: Sequence[int],
    single: dict[str, dict[int, dict[str, float]]],
    world: dict[str, dict[int, dict[str, dict[str, float]]]] | None,
) -> dict[str, Any]:
    """Per setup: µs per step and per parameter at each depth, the slope, the ratios."""
    rows: dict[str, Any] = {}
    for setup, by_depth in single.items():
        med = [by_depth[d]["median"] for d in depths]
        rows[setup] = {
            "kind": "single",
            "what": "opt.step()",
            "us_per_step": {str(d): by_depth[d] for d in depths},
            "us_per_param": {str(d): by_depth[d]["median"] / params_of(d) for d in depths},
            "slope_us_per_param": slope(depths, med),
            "ratio_to_adamw": {
                str(d): by_depth[d]["median"] / single[REFERENCE][d]["median"] for d in depths
            },
        }
    for setup, by_depth in (world or {}).items():
        step = [by_depth[d]["step"]["median"] for d in depths]
        backward = [by_depth[d]["backward"]["median"] for d in depths]
        bare = [world["bare"][d]["backward"]["median"] for d in depths]  # type: ignore[index]
        rows[setup] = {
            "kind": "world",
            "what": "forward, backward, opt.step() on 2 gloo ranks",
            "us_per_step": {str(d): by_depth[d] for d in depths},
            "us_per_param": {str(d): by_depth[d]["step"]["median"] / params_of(d) for d in depths},
            "slope_us_per_param": slope(depths, step),
            "backward_slope_us_per_param": slope(depths, backward),
            "hooks_us_per_param": {
                str(d): (b - bb) / params_of(d)
                for d, b, bb in zip(depths, backward, bare, strict=True)
            },
        }
        if setup != "bare" and world is not None:
            rows[setup]["ratio_to_adamw_ddp"] = {
                str(d): by_depth[d]["step"]["median"] / world[WORLD_REFERENCE][d]["step"]["median"]
                for d in depths
            }
    return rows


def print_table(result: dict[str, Any]) -> None:
    depths = result["depths"]
    head = ["setup", "what"]
    head += [f"µs/step L={d}" for d in depths] + [f"µs/param L={d}" for d in depths]
    head += ["slope µs/param", "× AdamW (largest L)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    last = str(depths[-1])
    for setup, row in result["rows"].items():
        if setup == "bare":
            continue
        phase = "step" if row["kind"] == "world" else None
        cells_of = [row["us_per_step"][str(d)] for d in depths]
        steps = [(c[phase] if phase else c)["median"] for c in cells_of]
        ratio = row.get("ratio_to_adamw", row.get("ratio_to_adamw_ddp", {})).get(last)
        cells = [setup, "opt.step()" if phase is None else "opt.step(), 2 ranks"]
        cells += [f"{s:.0f}" for s in steps]
        cells += [f"{row['us_per_param'][str(d)]:.1f}" for d in depths]
        cells += [f"{row['slope_us_per_param']:.1f}", "" if ratio is None else f"{ratio:.2f}"]
        print("| " + " | ".join(cells) + " |")
    world = [s for s, r in result["rows"].items() if r["kind"] == "world" and s != "bare"]
    if world:
        print()
        print("| setup | " + " | ".join(f"backward µs L={d}" for d in depths)
              + " | hooks µs/param (largest L) | backward slope µs/param |")  # fmt: skip
        print("|" + "---|" * (len(depths) + 3))
        for setup in ("bare", *world):
            row = result["rows"][setup]
            cells = [setup]
            cells += [f"{row['us_per_step'][str(d)]['backward']['median']:.0f}" for d in depths]
            cells += [f"{row['hooks_us_per_param'][last]:.1f}"]
            cells += [f"{row['backward_slope_us_per_param']:.1f}"]
            print("| " + " | ".join(cells) + " |")


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = result["depths"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for setup, row in result["rows"].items():
        if setup == "bare":
            continue
        label = setup if row["kind"] == "single" else f"{setup} (2 ranks, step)"
        ax.plot(depths, [row["us_per_param"][str(d)] for d in depths], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layers L (4 parameters each)")
    ax.set_ylabel("µs per parameter per step (median)")
    meta = result["meta"]
    ax.set_title(f"optimizer step host cost — {meta['cpu']}, {meta['torch_threads']} thread(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=None, help="layers (8 32 128)")
    parser.add_argument("--width", type=int, default=None, help="matrix size (16; --quick: 8)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (5)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps a round (20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--world", type=int, default=2, help="ranks of the owner setups")
    parser.add_argument("--no-world", action="store_true", help="single-process setups only")
    parser.add_argument("--quick", action="store_true", help="a tiny run (depths 2 4)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the ranks")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tag", default="", help="added to the file names (e.g. before)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the single-process setups run (cuda: no two-rank setups)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    depths = args.depths or ([2, 4] if args.quick else list(DEPTHS))
    if len(depths) < 2:
        parser.error("--depths needs at least two depths for the slope")
    width = args.width or (8 if args.quick else 16)
    rounds = args.rounds or (1 if args.quick else 5)
    repeats = args.repeats or (2 if args.quick else 20)
    warmup = 1 if args.quick else args.warmup
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"timing steps of L in {depths} layers of {width}×{width} ...", flush=True)
    single = run_single(depths, width, rounds, repeats, warmup, args.device)
    world = None
    if not args.no_world and args.device == "cpu":
        world = run_world(depths, width, rounds, repeats, warmup, args.world, args.timeout)
    result: dict[str, Any] = {
        "depths": depths,
        "width": width,
        "params": {str(d): params_of(d) for d in depths},
        "rounds": rounds,
        "repeats": repeats,
        "world": None if world is None else args.world,
        "device": args.device,
        "rows": summarise(depths, single, world),
        "meta": machine_info(args.device),
    }
    result["meta"]["load_average_1min"] = {
        "before": load_before,
        "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"step-overhead-{args.device}" + ("-quick" if args.quick else "")
    stem += f"-{args.tag}" if args.tag else ""
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
