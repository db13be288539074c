"""Optimizer-state bytes per rank: AdamW under FSDP2 and each DMuon mode, fp32 vs bf16 state.

The step benchmark's GPT (``benchmarks/step_world.py``'s default ``WorldConfig``:
4 layers, d_model 384) trains 2 steps on N gloo ranks (CPU, one thread each) under

==================== =========================================================
``adamw_fsdp``       ``torch.optim.AdamW`` under FSDP2 (``fully_shard`` per block)
``owner_fsdp``       DMuon owner mode: ``fsdp.dedicate`` + ``fully_shard(ignored_params)``
``owner_fsdp_z3``    the same, ZeRO-3-like (``reshard_after_forward=True``)
``owner_ddp``        DMuon owner mode replacing DDP (scalars all-reduced)
``owner_ddp_zero1``  the same, scalars owned too (sharded AdamW state)
``replicated``       DMuon ``mode="replicated"`` under stock DDP
``sharded``          DMuon ``mode="sharded"`` under stock FSDP2
==================== =========================================================

each DMuon setup with ``state_dtype=None`` (fp32 state for the fp32 model) and
``state_dtype="bfloat16"``. Then each rank counts the bytes of every tensor in
``optimizer.state`` — DTensors by their local shard, views into one stacked buffer
by their storage, once — split into the matrix rules' state and the scalar
(AdamW) state. That figure is exact: it is what the optimizer holds, not an
estimate. Alongside, each rank's process peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``) after the 2 steps: every setup runs in fresh
processes (forked from this one, so the figure includes the interpreter and torch),
and it counts weights, gradients, activations and allocator slack too.

Beside each measured row, the optimizer state ``dmuon-plan`` predicts for it
(:func:`dmuon.optim.planner.memory.memory_per_rank` on the same model's
:class:`~dmuon.optim.planner.config.ModelSpec`, owners from
:func:`dmuon.comm.plan_owners`, the busiest rank): ``predicted_state_bytes``.
``--predict`` adds that figure to an existing result file without running anything.

    python benchmarks/state_memory.py --world 2
    python benchmarks/state_memory.py --world 4 --out benchmarks/results/state-memory-cpu-w4.json
    python benchmarks/state_memory.py --predict benchmarks/results/state-memory-cpu-w2.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sys
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.data import BatchSampler  # noqa: E402
from benchmarks.common.memory import state_bytes  # noqa: E402
from benchmarks.common.metrics import machine_info  # noqa: E402
from benchmarks.common.model import GPT  # noqa: E402
from benchmarks.step_world import WorldConfig  # noqa: E402
from dmuon.comm.testing import run_on_ranks  # noqa: E402

SETUPS = [
    "adamw_fsdp",
    "owner_fsdp",
    "owner_fsdp_z3",
    "owner_ddp",
    "owner_ddp_zero1",
    "replicated",
    "sharded",
]
STEPS = 2
# The planner's mode for each setup, and owner mode's scalar layout (memory_per_rank's
# `scalars`): FSDP2 shards them under fsdp.dedicate; ddp.dedicate all-reduces them (every
# rank steps them) or, with scalars="owner", plans them with the matrices.
PLANNER_MODE = {
    "adamw_fsdp": ("adamw", "sharded"),
    "owner_fsdp": ("owner", "sharded"),
    "owner_fsdp_z3": ("owner-z3", "sharded"),
    "owner_ddp": ("owner", "all_reduce"),
    "owner_ddp_zero1": ("owner", "owner"),
    "replicated": ("replicated", "sharded"),
    "sharded": ("sharded", "sharded"),
}


def predicted_state_bytes(setup: str, world: int, state_dtype: str | None) -> float:
    """The optimizer state ``dmuon-plan``'s memory model predicts for the busiest rank."""
    from dmuon.comm import plan_owners
    from dmuon.integrations.selection import split_parameters
    from dmuon.optim.planner.config import spec_from_module
    from dmuon.optim.planner.memory import memory_per_rank

    with torch.device("meta"):
        model = GPT(WorldConfig().gpt())
    spec = spec_from_module(model, "the step benchmark's GPT")
    mode, scalars = PLANNER_MODE[setup]
    if scalars == "owner":  # the items ddp.dedicate(scalars="owner") plans: scalars whole
        dedicated, _ = split_parameters(model, dedicate_rest=True)
        plan = plan_owners([item for item, _ in dedicated], world)
    else:
        plan = plan_owners(spec.matrices, world)
    memory = memory_per_rank(spec, plan, mode, state_dtype=state_dtype, scalars=scalars)
    return memory["optimizer_state"]


def build(setup: str, cfg: WorldConfig, state_dtype: str | None) -> tuple[Any, Any, Any]:
    """``(module to call, optimizer, dedication or None)`` for one setup on this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp
    from dmuon.optim import DMuon, param_groups

    model = GPT(cfg.gpt())
    world = dist.get_world_size()
    kw: dict[str, Any] = dict(lr=1e-3, weight_decay=0.1, ns_compute_dtype="float32")
    kw["state_dtype"] = state_dtype
    forward: Any = model
    ded = None
    if setup in ("adamw_fsdp", "owner_fsdp", "owner_fsdp_z3", "sharded"):
        mesh = init_device_mesh("cpu", (world,))
        ignored = None
        if setup.startswith("owner_fsdp"):
            ded = fsdp.dedicate(model, mesh, reshard_after_forward=setup.endswith("z3"))
            ignored = ded.params
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    elif setup == "replicated":
        forward = DDP(model)
    elif setup == "owner_ddp":
        ded = ddp.dedicate(model)
    elif setup == "owner_ddp_zero1":
        ded = ddp.dedicate(model, scalars="owner")
    if setup == "adamw_fsdp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    elif setup == "sharded":
        opt = DMuon(param_groups(model), mode="sharded", **kw)
    elif setup == "replicated":
        opt = DMuon(param_groups(model), mode="replicated", **kw)
    else:
        opt = DMuon(param_groups(model), distributed=ded, **kw)
    return forward, opt, ded


def rank_main(rank: int, world: int, setup: str, state_dtype: str | None) -> dict[str, Any]:
    import torch.nn.functional as F

    cfg = WorldConfig()
    forward, opt, ded = build(setup, cfg, state_dtype)
    data = torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(0))
    sampler = BatchSampler(data.to(torch.uint8), cfg.batch_per_rank * world, cfg.seq_len, seed=1)
    for t in range(STEPS):
        x, y = sampler.batch(t, rank=rank, world_size=world)
        logits = forward(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    if ded is not None:
        ded.wait()
    out: dict[str, Any] = state_bytes(opt)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return out


def run(world: int, timeout: float) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    runs = [("adamw_fsdp", None)] + [(s, d) for s in SETUPS[1:] for d in (None, "bfloat16")]
    for i, (setup, dtype) in enumerate(runs, 1):
        name = setup if dtype is None else f"{setup}+bf16"
        t0 = time.perf_counter()
        per_rank = run_on_ranks(rank_main, world, args=(setup, dtype), timeout=timeout)
        rows[name] = {
            "setup": setup,
            "state_dtype": dtype or "float32",
            "per_rank": per_rank,
            "max_state_bytes": max(r["matrix"] + r["scalar"] for r in per_rank),
            "max_matrix_bytes": max(r["matrix"] for r in per_rank),
            "max_scalar_bytes": max(r["scalar"] for r in per_rank),
            "max_peak_rss": max(r["peak_rss"] for r in per_rank),
            "predicted_state_bytes": predicted_state_bytes(setup, world, dtype),
        }
        print(f"[{i}/{len(runs)}] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def print_table(rows: dict[str, Any], world: int) -> None:
    mib = 1 << 20
    print(f"\noptimizer state per rank, world {world} (max over ranks; MiB)")
    print(
        f"{'setup':<22} {'state':>8} {'matrix':>8} {'scalar':>8} {'peak RSS':>9} {'predicted':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<22} {r['max_state_bytes'] / mib:8.2f} {r['max_matrix_bytes'] / mib:8.2f} "
            f"{r['max_scalar_bytes'] / mib:8.2f} {r['max_peak_rss'] / mib:9.1f} "
            f"{r['predicted_state_bytes'] / mib:9.2f}"
        )


def add_predictions(path: pathlib.Path) -> None:
    """Add ``predicted_state_bytes`` to every row of a result file, and print its table."""
    result = json.loads(path.read_text())
    for r in result["rows"].values():
        dtype = None if r["state_dtype"] == "float32" else r["state_dtype"]
        r["predicted_state_bytes"] = predicted_state_bytes(r["setup"], result["world"], dtype)
    result["predicted"] = "dmuon-plan's optimizer_state (planner.memory.memory_per_rank)"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result["rows"], result["world"])
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument(
        "--predict",
        type=pathlib.Path,
        default=None,
        metavar="JSON",
        help="add the planner's predicted state to this result file; run nothing",
    )
    args = p.parse_args()
    if args.predict is not None:
        add_predictions(args.predict)
        return 0
    rows = run(args.world, args.timeout)
    print_table(rows, args.world)
    out = args.out or ROOT / "benchmarks" / "results" / f"state-memory-cpu-w{args.world}.json"
    cfg = WorldConfig()
    result = {
        "world": args.world,
        "device": "cpu",
        # the shared record: CPU model, native bf16, versions, commit, world, threads
        "machine": machine_info("cpu", world_size=args.world, threads_per_rank=1),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head},
        "steps": STEPS,
        "what": "bytes of the tensors in optimizer.state per rank (exact; storages counted "
        "once, DTensors by local shard) and process peak RSS (ru_maxrss)",
        "rows": rows,
        "predicted": "dmuon-plan's optimizer_state (planner.memory.memory_per_rank)",
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
