"""``torch.compile`` after DMuon's ``dedicate`` on one device: equal to eager, no recompiles.

The GPU counterpart of ``tests-integration/test_compile.py`` (which runs two gloo ranks
on a CPU with the ``aot_eager`` backend): one process, a one-rank process group (NCCL
on CUDA, gloo on a CPU), the model on the device and compiled with ``inductor`` (its
Triton code generation on a GPU). For each way DMuon meets a model — owner mode after
``ddp.dedicate`` / ``fsdp.dedicate`` (each also ZeRO-3-like), replicated mode under
DDP, sharded mode under FSDP2 — a small residual MLP trains ``--steps`` steps compiled,
and the same model trains eagerly with the same optimizer. Reported per mode:

* the largest parameter difference to eager (``max_abs_diff``; inductor fuses and
  reorders fp32 arithmetic, so equality is to ``--tolerance``, 1e-4 by default, with
  TF32 off);
* dynamo's counters after every step (graph breaks, frames compiled, unique graphs):
  nothing may grow after the first step (no recompile), and every graph break must be
  DMuon's ``torch.compiler.disable``-d layer hooks.

Writes ``compile-check-<device>.json`` under ``--out`` and prints a table; exits 1 if a
mode fails either check. Nothing is timed.

    python benchmarks/compile_check.py                      # CUDA, inductor, every mode
    python benchmarks/compile_check.py --modes owner_ddp_z3,sharded
    python benchmarks/compile_check.py --dry-run            # CPU, aot_eager (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402
from dmuon.optim import DMuon, param_groups  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("owner_ddp", "owner_ddp_z3", "owner_fsdp", "owner_fsdp_z3", "replicated", "sharded")
HOOK_BREAK = "torch.compiler.disable"  # the reason dynamo gives for DMuon's layer hooks
OPT = dict(lr=0.02, weight_decay=0.1, ns_compute_dtype="float32", adamw_lr=3e-3, adamw_eps=1e-3)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Input matrix, two residual blocks (the FSDP2 units), a head: 6 matrices, 8 scalars.

    Also the model of ``tests-integration/test_compile.py``."""

    def __init__(self, d: int, inputs: int, outputs: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(inputs, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(2))
            self.head = nn.Linear(d, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=g).to(device), torch.randn(32, 8, generator=g).to(device)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
        for n, p in model.named_parameters()
    }


def setup(mode: str, model: Net, device: str) -> tuple[nn.Module, nn.Module, DMuon, Any]:
    """``model`` (on ``device``) prepared for ``mode`` over the default process group:
    ``(model, the module to call, DMuon, the dedication or None)``. Sharded mode is
    DMuon's detected mode for FSDP2's DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp

    kw: dict[str, Any] = dict(OPT)
    forward: nn.Module = model
    z3 = mode.endswith("_z3")
    if mode.startswith("owner_fsdp") or mode == "sharded":
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        ignored = None
        if mode != "sharded":
            ded = fsdp.dedicate(model, mesh, reshard_after_forward=z3)
            kw["distributed"], ignored = ded, ded.params
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    elif mode.startswith("owner_ddp"):
        kw["distributed"] = ddp.dedicate(model, reshard_after_forward=z3)
    else:  # replicated: the module inside DDP is compiled, as the integration test does
        forward = DDP(model)
        kw["mode"] = "replicated"
    return model, forward, DMuon(param_groups(model), **kw), kw.get("distributed")


def counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
    }


def check_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        net = Net(args.width, inputs=16, outputs=8).to(args.device)
        model, forward, opt, ded = setup(mode, net, args.device)
        if compiled and mode == "replicated":
            model.compile(backend=args.backend)
            run = forward
        elif compiled:
            run = torch.compile(forward, backend=args.backend)
        else:
            run = forward
        per_step = []
        for t in range(args.steps):
            x, y = batch(t, args.device)
            F.mse_loss(run(x), y).backward()
            opt.step()
            opt.zero_grad()
            per_step.append(counts())
        if ded is not None:
            ded.wait()
            ded.remove()
        reasons = sorted({str(r).splitlines()[0] for r in counters["graph_break"]})
        runs[compiled] = (params_of(model), per_step, reasons)
    (eager, _, _), (got, per_step, reasons) = runs[False], runs[True]
    diff = max(float((got[n] - eager[n]).abs().max()) for n in eager)
    grew = per_step[-1] != per_step[0]
    foreign = [r for r in reasons if HOOK_BREAK not in r]
    ok = diff <= args.tolerance and not grew and not foreign and per_step[0]["graphs"] >= 1
    return {
        "mode": mode,
        "max_abs_diff": diff,
        "counts": per_step,
        "grew_after_first_step": grew,
        "break_reasons": reasons,
        "unexpected_breaks": foreign,
        "ok": ok,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="inductor (default), or aot_eager")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--dry-run", action="store_true", help="CPU, aot_eager, 3 steps")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.steps, args.backend = "cpu", 3, args.backend or "aot_eager"
    args.backend = args.backend or "inductor"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--modes: {bad} not among {', '.join(MODES)}")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            rows = [check_mode(m, args) for m in modes]
        finally:
            dist.destroy_process_group()
    result = {
        "meta": {**machine_info(args.device), "backend": args.backend, "steps": args.steps},
        "tolerance": args.tolerance,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compile-check-{args.device}{'-dry-run' if args.dry_run else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"torch.compile ({args.backend}) vs eager on {args.device}, {args.steps} steps")
    print(f"{'mode':<15} {'max |Δ|':>9} {'breaks':>7} {'frames':>7} {'graphs':>7}  ok")
    for r in rows:
        c = r["counts"][-1]
        print(
            f"{r['mode']:<15} {r['max_abs_diff']:9.2e} {c['graph_breaks']:7d} "
            f"{c['frames']:7d} {c['graphs']:7d}  {'yes' if r['ok'] else 'NO'}"
        )
        for reason in r["unexpected_breaks"]:
            print(f"    unexpected graph break: {reason}")
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
