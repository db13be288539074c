"""Communication benchmark: bytes and time per optimizer step for each execution mode.

For the matrix list of a GPT-style model it runs, on N real ranks (gloo on CPU
processes by default, NCCL with one GPU per rank when ``--backend nccl``), one
optimizer step's worth of communication in each mode and reports, per step:

| mode | collectives |
|---|---|
| ``fp32 all-reduce`` | baseline: one all-reduce of every gradient (DDP) |
| ``owner`` | ``reduce_to_owners`` + ``broadcast_from_owners`` (DMuon) |
| ``replicated`` | all-reduce of the gradients + ``all_gather_updates`` |
| ``sharded`` | ``shard_all_to_all`` + ``shard_all_to_all_reverse`` (FSDP2) |
| ``sign packed`` | ``majority_vote(method="packed")`` over every entry (Sign-Muon) |
| ``sign int8`` | ``majority_vote(method="int8")`` |

Measured: the median wall time of a step (slowest rank, after a barrier) and
the bytes each rank sent by :class:`dmuon.comm.CommStats`. Predicted: the α–β
model of :func:`dmuon.comm.cost_model` with α and β fitted on this machine from
a small and a large all-reduce, applied to the collectives the mode issues, and
the ideal bytes (no padding). The prediction is wire time only: local work
(packing, the vote, copies into buckets) is not in it; the time of packing and
unpacking every vote is reported next to the table. Writes
``benchmarks/results/comm-<device>-<backend>-w<N>.json`` and ``.png`` per world
size and prints a table. Never asserts on time.

    python benchmarks/comm.py                          # world sizes 2 and 4, gloo on CPU
    python benchmarks/comm.py --world-sizes 2 --layers 2 --d-model 128 --repeats 3
    python benchmarks/comm.py --backend nccl --world-sizes 2 4 8 --layers 12 --d-model 768
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import file_tag, machine_info  # noqa: E402
from dmuon.comm import (  # noqa: E402
    VOTES_PER_BYTE,
    CommStats,
    MatrixItem,
    all_gather_updates,
    broadcast_from_owners,
    cost_model,
    majority_vote,
    make_buckets,
    pack_votes,
    plan_owners,
    reduce_to_owners,
    shard_all_to_all,
    shard_all_to_all_reverse,
    shard_range,
    unpack_votes,
)
from dmuon.comm.testing import run_on_ranks  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MODES = ["fp32 all-reduce", "owner", "replicated", "sharded", "sign packed", "sign int8"]


def gpt_items(layers: int, d: int) -> list[MatrixItem]:
    """GPT-style blocks: q, k, v, o (d×d), MLP fc (4d×d) and proj (d×4d), fp32."""
    shapes = [("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d))]
    shapes += [("fc", (4 * d, d)), ("proj", (d, 4 * d))]
    return [
        MatrixItem(f"h.{i}.{part}", shape, layer=f"h.{i}")
        for i in range(layers)
        for part, shape in shapes
    ]


def _sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _timed(step, repeats: int, device: torch.device) -> list[float]:
    """Wall time of ``step`` on the slowest rank, ``repeats`` times after 2 warm-ups."""
    out = []
    for k in range(repeats + 2):
        dist.barrier()
        start = _sync_time(device)
        step()
        elapsed = torch.tensor([_sync_time(device) - start], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if k >= 2:
            out.append(elapsed.item())
    return out


def _fit_alpha_beta(n: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """α from an 8-byte all-reduce, β from a 16 MiB one (ring model: 2(N−1) steps)."""
    small = torch.zeros(2, device=device)
    large = torch.zeros(4 << 20, device=device)
    t_small = statistics.median(_timed(lambda: dist.all_reduce(small), repeats, device))
    t_large = statistics.median(_timed(lambda: dist.all_reduce(large), repeats, device))
    alpha = t_small / (2 * (n - 1))
    moved = 2 * (n - 1) / n * large.nbytes
    bandwidth = moved / max(t_large - 2 * (n - 1) * alpha, 1e-9)
    return alpha, bandwidth


def _predict(plan, n: int, alpha: float, bandwidth: float) -> dict[str, tuple[float, float]]:
    """(seconds, bytes sent per rank) of each mode under the α–β model, without padding."""

    def c(op: str, nbytes: int) -> tuple[float, float]:
        cost = cost_model(op, int(nbytes), n, alpha=alpha, bandwidth=bandwidth)
        return cost.seconds, cost.bytes_sent

    def add(*parts: tuple[float, float]) -> tuple[float, float]:
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    P = sum(i.nbytes for i in plan.items)
    per_owner = [sum(i.nbytes for i in plan.items_of(r)) for r in range(n)]
    owner = add(
        *(c("reduce", b) for b in per_owner if b), *(c("broadcast", b) for b in per_owner if b)
    )
    replicated = add(c("all_reduce", P), c("all_gather", P))
    sharded = add(c("all_to_all", P // n), c("all_to_all", P // n))
    entries = sum(i.numel for i in plan.items)
    votes = math.ceil(entries / VOTES_PER_BYTE)  # bytes: five votes per byte
    packed = add(c("all_to_all", votes), c("all_gather", votes))
    return {
        "fp32 all-reduce": c("all_reduce", P),
        "owner": owner,
        "replicated": replicated,
        "sharded": sharded,
        "sign packed": packed,
        "sign int8": c("all_reduce", entries),
    }


def bench_rank(
    rank: int, n: int, layers: int, d: int, repeats: int, backend: str
) -> dict[str, Any]:
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu")
    items = gpt_items(layers, d)
    plan = plan_owners(items, n)
    gen = torch.Generator().manual_seed(rank)
    grads = {i.name: torch.randn(i.shape, generator=gen).to(device) for i in items}
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    buckets = make_buckets(plan, device=device)
    for b in buckets:
        b.pack(grads)
    shards = {}
    for i in items:
        start, length = shard_range(i.shape[0], n, rank)
        shards[i.name] = grads[i.name][start : start + length].contiguous()
    updates = {name: grads[name] for name in plan.names_of(rank)}
    owned_full = shard_all_to_all(shards, plan, stats=CommStats()).wait()

    def all_reduce_step():
        dist.all_reduce(flat)

    def owner_step(stats):
        reduce_to_owners(buckets, plan, stats=stats).wait()
        broadcast_from_owners(buckets, plan, stats=stats).wait()

    def replicated_step(stats):
        dist.all_reduce(flat)
        stats.record_collective("all_reduce", "all_reduce", nbytes=flat.nbytes, world_size=n)
        all_gather_updates(updates, plan, stats=stats).wait()

    def sharded_step(stats):
        shard_all_to_all(shards, plan, stats=stats).wait()
        shard_all_to_all_reverse(owned_full, plan, stats=stats).wait()

    steps = {
        "fp32 all-reduce": lambda stats: (
            all_reduce_step(),
            stats.record_collective("all_reduce", "all_reduce", nbytes=flat.nbytes, world_size=n),
        ),
        "owner": owner_step,
        "replicated": replicated_step,
        "sharded": sharded_step,
        "sign packed": lambda stats: majority_vote(flat, method="packed", stats=stats),
        "sign int8": lambda stats: majority_vote(flat, method="int8", stats=stats),
    }
    alpha, bandwidth = _fit_alpha_beta(n, device, repeats)
    # Local work of the sign modes, which the α–β model (wire time only) leaves out.
    local = _timed(lambda: unpack_votes(pack_votes(flat), flat.shape), repeats, device)
    predicted = _predict(plan, n, alpha, bandwidth)
    rows = []
    for k, mode in enumerate(MODES):
        if rank == 0:
            print(f"  [N={n}] {mode:<16} ({k + 1}/{len(MODES)})", flush=True)
        stats = CommStats()
        steps[mode](stats)  # bytes of one step
        sent = torch.tensor([stats.total_bytes_sent], dtype=torch.float64, device=device)
        dist.all_reduce(sent)
        times = _timed(lambda mode=mode: steps[mode](CommStats()), repeats, device)
        rows.append(
            {
                "mode": mode,
                "seconds": statistics.median(times),
                "seconds_all": times,
                "bytes_sent_per_rank": sent.item() / n,
                "predicted_seconds": predicted[mode][0],
                "predicted_bytes_per_rank": predicted[mode][1],
            }
        )
    return {
        "rows": rows,
        "alpha": alpha,
        "bandwidth": bandwidth,
        "imbalance": plan.imbalance(),
        "pack_unpack_seconds": statistics.median(local),
        "param_bytes": sum(i.nbytes for i in items),
        "matrices": len(items),
    }


def run_info(backend: str, world_size: int) -> dict[str, Any]:
    """The shared machine record (CPU model, native bf16, versions, commit) of the ranks
    that ran, plus the backend: every rank runs one torch thread (``run_on_ranks``'
    default)."""
    device = "cuda" if backend == "nccl" else "cpu"
    info = machine_info(device, world_size=world_size, threads_per_rank=1)
    info["backend"] = backend
    return info


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = next(r for r in result["rows"] if r["mode"] == "fp32 all-reduce")
    table = Table(
        title=f"{result['meta']['backend']} · N={result['world_size']} · "
        f"{result['matrices']} matrices, {result['param_bytes'] / 2**20:.1f} MiB fp32 · "
        f"fitted α={result['alpha'] * 1e6:.0f} µs, {result['bandwidth'] / 1e9:.2f} GB/s"
    )
    for h in ["mode", "ms/step", "α–β ms", "MiB sent/rank", "ideal MiB", "of fp32 all-reduce"]:
        table.add_column(h, justify="left" if h == "mode" else "right")
    for r in result["rows"]:
        table.add_row(
            r["mode"],
            f"{r['seconds'] * 1e3:.2f}",
            f"{r['predicted_seconds'] * 1e3:.2f}",
            f"{r['bytes_sent_per_rank'] / 2**20:.3f}",
            f"{r['predicted_bytes_per_rank'] / 2**20:.3f}",
            f"{r['bytes_sent_per_rank'] / base['bytes_sent_per_rank']:.3f}",
        )
    Console(width=120).print(table)
    print(
        f"local pack_votes + unpack_votes of all {result['param_bytes'] // 4} entries: "
        f"{result['pack_unpack_seconds'] * 1e3:.2f} ms (not in the α–β prediction)"
    )


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    modes = [r["mode"] for r in rows]
    xs = range(len(modes))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    left.bar(
        [x - width / 2 for x in xs],
        [r["bytes_sent_per_rank"] / 2**20 for r in rows],
        width,
        label="measured (CommStats)",
    )
    left.bar(
        [x + width / 2 for x in xs],
        [r["predicted_bytes_per_rank"] / 2**20 for r in rows],
        width,
        label="ideal (α–β model)",
    )
    left.set_ylabel("MiB sent per rank per step")
    left.set_yscale("log")
    right.bar(
        [x - width / 2 for x in xs],
        [r["seconds"] * 1e3 for r in rows],
        width,
        label="measured (median)",
    )
    right.bar(
        [x + width / 2 for x in xs],
        [r["predicted_seconds"] * 1e3 for r in rows],
        width,
        label="α–β prediction",
    )
    right.set_ylabel("ms per step")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xticks(list(xs), modes, rotation=25, ha="right")
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=9, frameon=False)
    fig.suptitle(
        f"dmuon.comm, {result['meta']['backend']}, N={result['world_size']}, "
        f"{result['matrices']} matrices ({result['param_bytes'] / 2**20:.0f} MiB fp32), "
        f"{result['meta']['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument(
        "--tag",
        type=file_tag,
        default="",
        help="suffix of the result files: --tag quick writes comm-<device>-<backend>-w<N>-quick",
    )
    args = p.parse_args(argv)
    if args.backend == "nccl" and torch.cuda.device_count() < max(args.world_sizes):
        print(f"nccl needs one GPU per rank; found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    device = "cuda" if args.backend == "nccl" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    for n in args.world_sizes:
        if n < 2:
            print("world sizes below 2 move no bytes; skipped", file=sys.stderr)
            continue
        print(f"world size {n}: {len(MODES)} modes × {args.repeats} repeats", flush=True)
        out = run_on_ranks(
            bench_rank,
            n,
            args=(args.layers, args.d_model, args.repeats, args.backend),
            backend=args.backend,
            start_method="spawn" if args.backend == "nccl" else "fork",
            timeout=1800,
        )[0]
        result = {
            "meta": run_info(args.backend, n),
            "world_size": n,
            **out,
            "config": {"layers": args.layers, "d_model": args.d_model, "repeats": args.repeats},
        }
        stem = f"comm-{device}-{args.backend}-w{n}{args.tag}"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
        plot(result, args.out / f"{stem}.png")
        print_table(result)
        print(f"wrote {args.out / (stem + '.json')} and .png\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
