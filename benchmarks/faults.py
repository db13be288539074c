"""How fast every surviving rank leaves a step when a peer dies, hangs or skips a step.

World of 3 CPU ranks (gloo), a 3-layer MLP, ``DMuon(timeout=T)``. In step 2, rank 2
either kills itself with SIGKILL or sleeps, after stepping its first layer — while
the others already wait for its results — or (``skip``) runs forward and backward
and then skips ``opt.step()``, as a loop that catches an error and ``continue``s,
or (``stall``) sleeps between its forward and its backward, while the others'
backward waits for what it sends (owner mode with ``reshard_after_forward=True``:
the re-broadcast of the freed weights its layers own), or (``partial``, owner mode
under ``fsdp.dedicate``) leaves its last block out of the forward, so that block's
bias, which FSDP2 synchronises, is used on some ranks only (an MoE expert no token
reached), or (``nosave``) does not join the checkpoint the others save after the
step (``checkpoint.full_state_dict``).
For each mode and fault, every survivor reports the error class, why
(``peer_died``: gloo saw the connection close; ``timeout``: no answer within
``T``), which rank the error names (the one absent from the roll call after a
death, the one alive outside any DMuon collective after a hang or a skip; see
:mod:`dmuon.comm.roll_call`; for ``partial``, the parameters a
:class:`~dmuon.integrations.PartialUseError` names, on every rank including the
faulty one) and the seconds from the start of the failing iteration to the raise.
Prints a table and writes ``benchmarks/results/faults.json`` (``--out`` elsewhere), with
the machine. Nothing here asserts on time.

    python benchmarks/faults.py               # T = 2 s
    python benchmarks/faults.py --timeout 5
    python benchmarks/faults.py --cases owner:kill sign:skip --out faults-two.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402
from dmuon.comm import CollectiveError  # noqa: E402
from dmuon.comm.testing import RankFailure, RankOutcome, rank_store, run_on_ranks  # noqa: E402
from dmuon.optim import DMuon, param_groups  # noqa: E402

WORLD, FAULTY = 3, 2
#: every (mode, fault) the default run covers, in order
CASES = [(m, f) for m in ("owner", "replicated", "sharded") for f in ("kill", "hang", "skip")]
CASES += [("sign", "skip"), ("owner_reshard", "stall"), ("owner_fsdp", "partial")]
CASES += [("owner", "nosave")]
_TIMEOUT = [2.0]  # set by main(); read by the forked ranks


class Blocks(nn.Module):
    """Three ``Linear(32, 32) → tanh`` blocks; ``partial=True`` leaves out the last."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        for block in self.blocks[:2] if partial else self.blocks:
            x = block(x)
        return x


def _build(mode: str, world: int, timeout: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp

    torch.manual_seed(0)
    model = Blocks()
    forward: nn.Module = model
    kw: dict = {"timeout": timeout, "store": rank_store()}
    if mode == "owner":
        kw["distributed"] = ddp.dedicate(model)
    elif mode == "owner_reshard":  # ZeRO-3-like: weights freed after forward, re-broadcast
        kw["distributed"] = ddp.dedicate(model, reshard_after_forward=True)
    elif mode == "owner_fsdp":  # the matrices dedicated, the biases FSDP2's (one unit)
        mesh = init_device_mesh("cpu", (world,))
        kw["distributed"] = ded = fsdp.dedicate(model, mesh)
        fully_shard(model, mesh=mesh, ignored_params=ded.params)
    elif mode == "replicated":
        forward, kw["mode"] = DDP(model), "replicated"
    elif mode == "sign":
        kw["mode"], kw["rule"] = "sign", "sign_muon"
    else:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return forward, DMuon(param_groups(model), **kw)


def _faulty(inner, fault: str):
    """``inner`` that kills this process (or sleeps) after its second call."""
    calls = []

    def step(*args, **kwargs):
        inner(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(4 * _TIMEOUT[0])  # longer than the deadline, then leave
            raise SystemExit("the hanging rank gives up")

    return step


def _rank(rank: int, world: int, mode: str, fault: str, timeout: float):
    from dmuon.integrations import PartialUseError, checkpoint

    forward, opt = _build(mode, world, timeout)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 4):
        if rank == FAULTY and step == 2 and fault in ("kill", "hang"):
            opt.step_matrices = _faulty(opt.step_matrices, fault)
        t0 = time.monotonic()
        try:
            partial = rank == FAULTY and step == 2 and fault == "partial"
            out = forward(torch.randn(8, 32, generator=g), partial=partial)
            loss = F.mse_loss(out, torch.zeros(8, 32))
            if rank == FAULTY and step == 2 and fault == "stall":
                time.sleep(4 * timeout)  # stalls before its backward, then leaves
                raise SystemExit("the stalled rank gives up")
            loss.backward()
            if rank == FAULTY and step == 2 and fault == "skip":
                continue  # the misuse: this rank skips opt.step()
            opt.step()
            if step == 2 and fault == "nosave":
                if rank == FAULTY:  # takes another branch: never saves, then leaves
                    time.sleep(4 * timeout)
                    raise SystemExit("the rank that did not save gives up")
                checkpoint.full_state_dict(forward, opt)
        except PartialUseError as err:
            return {
                "reason": "partial_use",
                "named": err.names,
                "seconds": time.monotonic() - t0,
                "message": str(err),
            }
        except CollectiveError as err:
            roll = err.roll_call
            named = [err.dead_rank] if err.dead_rank is not None else (roll.stalled if roll else [])
            return {
                "reason": err.reason,
                "named": named,
                "seconds": time.monotonic() - t0,
                "message": str(err),
            }
        opt.zero_grad()
    return {"reason": "none", "named": [], "seconds": 0.0, "message": ""}


def _case(text: str) -> tuple[str, str]:
    mode, _, fault = text.partition(":")
    if (mode, fault) not in CASES:
        known = " ".join(f"{m}:{f}" for m, f in CASES)
        raise argparse.ArgumentTypeError(f"unknown case {text!r}; choose from {known}")
    return mode, fault


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=2.0, help="DMuon(timeout=...) in s")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=ROOT / "benchmarks" / "results" / "faults.json",
        help="the JSON file to write (default: benchmarks/results/faults.json)",
    )
    parser.add_argument(
        "--cases",
        type=_case,
        nargs="+",
        default=CASES,
        metavar="MODE:FAULT",
        help="the cases to run (default: all)",
    )
    args = parser.parse_args(argv)
    _TIMEOUT[0] = args.timeout
    rows = []
    for mode, fault in args.cases:
        # a skipping rank waits in DDP's/FSDP2's own collective: the harness ends it
        limit = 30 if fault == "skip" else 90
        try:
            values = run_on_ranks(_rank, WORLD, args=(mode, fault, args.timeout), timeout=limit)
            outcomes = [RankOutcome(r, "ok", value=v) for r, v in enumerate(values)]
        except RankFailure as failure:
            outcomes = failure.outcomes
        for o in outcomes:
            if o.rank == FAULTY and fault != "partial":  # partial: every rank must raise
                continue
            v = (
                o.value
                if o.status == "ok"
                else {"reason": o.status, "named": [], "seconds": float("nan")}
            )
            rows.append({"mode": mode, "fault": fault, "rank": o.rank, **v})
            print(
                f"{mode:13s} {fault:7s} rank {o.rank}: {v['reason']:9s} "
                f"names rank(s) {v['named']}  {v['seconds']:6.2f} s"
            )
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info("cpu", world_size=WORLD, threads_per_rank=1)
    result = {"timeout_s": args.timeout, "world": WORLD, "machine": machine, "rows": rows}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
