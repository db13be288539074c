"""Soak test: train with periodic checkpoints, kill ranks for real, resume, compare.

A small GPT (benchmarks/common) trains ``--steps`` steps on ``--nproc`` CPU ranks
(gloo) with DMuon in owner mode under FSDP2, saving a DCP checkpoint
(:mod:`dmuon.integrations.checkpoint`) every ``--every`` steps. Under ``torchrun
--max_restarts K`` a rank SIGKILLs itself at ``K`` random steps (a different rank
each time); torchrun's elastic agent restarts every rank and the run resumes from
the newest complete checkpoint. The same run without kills is the reference.

Reported: resumes, steps lost beyond the last checkpoint before each kill (must be
0), steps redone, and the divergence of the final weights from the reference
(bitwise equality is expected: same world size, same plan, CPU). Writes
``soak-cpu-gloo-w<N>.json`` (with the machine) and ``.png`` (loss per step, kills
marked) into ``--results`` (default ``benchmarks/results``; ``--out`` is the work
directory of the checkpoints) and prints a table. Not part of CI; never asserts on
time. Exits non-zero when a step was lost or the weights diverged.

    python benchmarks/soak.py                       # 4 ranks, 120 steps, 3 kills
    python benchmarks/soak.py --steps 600 --kills 10 --every 20   # ~30 minutes on 2 cores
    python benchmarks/soak.py --nproc 2 --steps 12 --every 4 --kills 1 --results soak-quick
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


# ------------------------------------------------------------------ the worker


def _log(path: pathlib.Path, **event: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({**event, "t": time.time()}) + "\n")


def worker(args: argparse.Namespace) -> None:
    """One rank of the training job (run by torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(ROOT))
    from benchmarks.common.data import BatchSampler
    from benchmarks.common.model import GPT, GPTConfig
    from dmuon.integrations import checkpoint, fsdp
    from dmuon.optim import DMuon, param_groups

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    root = pathlib.Path(args.dir)
    events = root / "events.jsonl"
    config = GPTConfig.tiny(seq_len=32, n_layer=args.layers, d_model=args.d_model, seed=1)
    model = GPT(config)
    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), lr=0.02, distributed=ded)
    data = torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(7))
    sampler = BatchSampler(data.to(torch.uint8), args.batch, 32, seed=3)

    done = [
        int(p.name.removeprefix("step_")) for p in root.glob("step_*") if (p / ".metadata").exists()
    ]
    start = 0
    if done:
        start = checkpoint.load(root / f"step_{max(done)}", model, opt)["step"]
        if rank == 0:
            _log(events, event="resumed", step=start, attempt=attempt, world=world)
    kills = [int(k) for k in args.kill_at.split(",") if k]
    for step in range(start, args.steps):
        if attempt < len(kills) and step == kills[attempt] and rank == (attempt + 1) % world:
            _log(events, event="kill", step=step, rank=rank, attempt=attempt)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = sampler.batch(step, rank=rank, world_size=world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            _log(events, event="loss", step=step, loss=loss.item(), attempt=attempt)
        if (step + 1) % args.every == 0:
            checkpoint.save(root / f"step_{step + 1}", model, opt, extra={"step": step + 1})
            if rank == 0:
                _log(events, event="checkpoint", step=step + 1, attempt=attempt)
    final = checkpoint.full_state_dict(model, opt)
    if rank == 0:
        torch.save(final["model"], root / "final.pt")
    dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher


def launch(args: argparse.Namespace, out: pathlib.Path, kills: list[int]) -> float:
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(args.nproc), "--max_restarts", str(len(kills)),
        __file__, "--worker", "--dir", str(out), "--steps", str(args.steps),
        "--every", str(args.every), "--kill-at", ",".join(map(str, kills)),
        "--layers", str(args.layers), "--d-model", str(args.d_model), "--batch", str(args.batch),
    ]  # fmt: skip
    t0 = time.time()
    log = open(out / "torchrun.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    seen = 0
    while proc.poll() is None:
        time.sleep(2)
        lines = (
            (out / "events.jsonl").read_text().splitlines()
            if (out / "events.jsonl").exists()
            else []
        )
        for line in lines[seen:]:
            e = json.loads(line)
            if e["event"] != "loss":
                print(
                    f"  [{out.name} {time.time() - t0:6.0f}s] {e['event']} {e['step']}", flush=True
                )
        seen = len(lines)
        if time.time() - t0 > args.timeout:
            proc.kill()
            raise SystemExit(
                f"{out.name}: no end after {args.timeout} s; see {out / 'torchrun.log'}"
            )
    log.close()
    if proc.returncode != 0:
        raise SystemExit(
            f"{out.name}: torchrun failed ({proc.returncode}); see {out / 'torchrun.log'}"
        )
    return time.time() - t0


def analyse(events: list[dict], kills: list[int]) -> list[dict]:
    """Per kill: the last checkpoint before it, where the run resumed, steps lost/redone."""
    rows = []
    last_ckpt = 0
    pending: dict | None = None
    for e in events:
        if e["event"] == "checkpoint":
            last_ckpt = max(last_ckpt, e["step"])
        elif e["event"] == "kill":
            pending = {"kill_step": e["step"], "rank": e["rank"], "last_checkpoint": last_ckpt}
        elif e["event"] == "resumed" and pending is not None:
            pending["resumed_at"] = e["step"]
            pending["steps_lost"] = pending["last_checkpoint"] - e["step"]
            pending["steps_redone"] = pending["kill_step"] - e["step"]
            rows.append(pending)
            pending = None
    if pending is not None:
        rows.append({**pending, "resumed_at": None, "steps_lost": None, "steps_redone": None})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="chooses the kill steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    parser.add_argument(
        "--results",
        type=pathlib.Path,
        default=RESULTS,
        help="folder for the JSON and PNG (default: benchmarks/results)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return

    import torch

    if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
        sys.path.insert(0, str(ROOT))
    from benchmarks.common.metrics import machine_info

    rng = random.Random(args.seed)
    kills = sorted(rng.sample(range(args.every + 1, args.steps), args.kills))
    work = pathlib.Path(args.out or tempfile.mkdtemp(prefix="dmuon-soak-"))
    print(f"soak: {args.nproc} ranks, {args.steps} steps, checkpoint every {args.every}, "
          f"kills before steps {kills}; work in {work}", flush=True)  # fmt: skip
    t_killed = launch(args, work / "killed", kills)
    t_straight = launch(args, work / "straight", [])
    events = [json.loads(x) for x in (work / "killed" / "events.jsonl").read_text().splitlines()]
    rows = analyse(events, kills)
    resumed = torch.load(work / "killed" / "final.pt", weights_only=True)
    straight = torch.load(work / "straight" / "final.pt", weights_only=True)
    diverged = [k for k in straight if not torch.equal(resumed[k], straight[k])]
    max_diff = max(float((resumed[k] - straight[k]).abs().max()) for k in straight)

    print("\n| kill before step | rank | last checkpoint | resumed at | steps lost | redone |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kill_step']} | {r['rank']} | {r['last_checkpoint']} | {r['resumed_at']} "
              f"| {r['steps_lost']} | {r['steps_redone']} |")  # fmt: skip
    lost = sum(r["steps_lost"] or 0 for r in rows)
    print(f"\nresumes: {len([r for r in rows if r['resumed_at'] is not None])}/{len(kills)}, "
          f"steps lost beyond the last checkpoint: {lost}, parameters diverged: "
          f"{len(diverged)}/{len(straight)} (max |Δ| {max_diff:.3g}); "
          f"wall: {t_killed:.0f} s with kills, {t_straight:.0f} s without")  # fmt: skip
    summary = {
        "nproc": args.nproc, "steps": args.steps, "every": args.every, "kills": kills,
        "model": {"layers": args.layers, "d_model": args.d_model, "batch": args.batch},
        "per_kill": rows, "resumes": len([r for r in rows if r["resumed_at"] is not None]),
        "steps_lost": lost, "diverged_parameters": diverged, "max_abs_diff": max_diff,
        "seconds_with_kills": t_killed, "seconds_without": t_straight,
        "command": _command(sys.argv[1:] if argv is None else argv),
        # every rank runs one thread: launch() sets OMP_NUM_THREADS=1 for torchrun
        "machine": machine_info("cpu", world_size=args.nproc, threads_per_rank=1),
    }  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"soak-cpu-gloo-w{args.nproc}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(events, work / "straight" / "events.jsonl", rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")
    if lost or diverged or len(rows) != len(kills) or any(r["resumed_at"] is None for r in rows):
        raise SystemExit(1)


def _command(argv: list[str]) -> str:
    """The command line, without the work and results directories (paths of this machine)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--results"):
            skip = True
        elif not a.startswith(("--out=", "--results=")):
            out.append(a)
    return " ".join(["python benchmarks/soak.py", *out])


def _plot(events: list[dict], straight: pathlib.Path, rows: list[dict], path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print("matplotlib not installed: no PNG")
        return
    ref = [json.loads(x) for x in straight.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(8, 4))
    ref_loss = [e for e in ref if e["event"] == "loss"]
    ax.plot([e["step"] for e in ref_loss], [e["loss"] for e in ref_loss], lw=3, alpha=0.4,
            label="uninterrupted")  # fmt: skip
    attempts = sorted({e["attempt"] for e in events if e["event"] == "loss"})
    for a in attempts:
        pts = [e for e in events if e["event"] == "loss" and e["attempt"] == a]
        ax.plot([e["step"] for e in pts], [e["loss"] for e in pts], lw=1, label=f"attempt {a}")
    for r in rows:
        ax.axvline(r["kill_step"], color="red", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (rank 0's shard)")
    ax.set_title("Soak: SIGKILL (dotted) → torchrun restart → resume from the last checkpoint")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
