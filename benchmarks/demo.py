"""The demo: a byte-level GPT trained on N ranks with DMuon (owner mode + FSDP2) and AdamW.

Both runs train the GPT of ``benchmarks/common`` from the same initial weights on
the same batches of the built-in corpus (the Python standard library's sources,
held out by file) under FSDP2, on N ranks: N gloo processes on a CPU (one thread
each), or N GPUs with NCCL when CUDA offers that many. They differ in three lines:

    ded = dedicate(model, mesh)                                    # DMuon only
    fully_shard(block, mesh=mesh, ignored_params=ded.params)       # (AdamW: no ignored_params)
    opt = DMuon(param_groups(model), lr=..., distributed=ded)      # (AdamW: torch.optim.AdamW)

Rank 0 shows a progress bar per run, then prints the training loss side by side
at a few steps, the final validation loss and the step time of each, and writes
``benchmarks/results/demo-<device>-w<N>[-<size>].json`` and ``.png`` (loss
against step and against wall-clock).

    python benchmarks/demo.py                     # 4 ranks, the default size (< 5 min on 2 cores)
    python benchmarks/demo.py --world 2 --steps 40 --size tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.data import BatchSampler, load_corpus, validation_batches  # noqa: E402
from benchmarks.common.metrics import machine_info  # noqa: E402
from benchmarks.common.model import GPT, GPTConfig  # noqa: E402
from benchmarks.common.optimizers import lr_multiplier  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
RUNS = ("dmuon", "adamw")
LABELS = {"dmuon": "DMuon (owner + FSDP2)", "adamw": "AdamW (FSDP2)"}


@dataclasses.dataclass(frozen=True)
class Size:
    """Model and batch of one demo size."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    global_batch: int
    steps: int

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.n_layer,
            d_model=self.d_model,
            n_head=self.n_head,
            seq_len=self.seq_len,
            seed=0,
        )


SIZES = {
    "tiny": Size(n_layer=2, d_model=32, n_head=2, seq_len=32, global_batch=8, steps=6),
    "small": Size(n_layer=2, d_model=128, n_head=4, seq_len=64, global_batch=16, steps=80),
}
# Learning rates (the peak of a warm-up + cosine schedule). DMuon's matrices use the
# RMS-matched convention (update RMS 0.2·lr, AdamW's scale); its embeddings, head
# and norms take AdamW at AdamW's lr. NS in fp32 on a CPU: bf16 matmul is only
# fast with AVX-512-BF16/AMX.
LR = {"dmuon": 2e-2, "adamw": 3e-3}
WEIGHT_DECAY = 0.1


@dataclasses.dataclass(frozen=True)
class Settings:
    size: Size
    steps: int
    eval_every: int
    eval_batches: int
    device: str
    show_progress: bool


def _optimizer(name: str, model: GPT, mesh: Any, device: torch.device) -> tuple[Any, Any]:
    """Shard ``model`` with FSDP2 and build its optimizer: DMuon owner mode or AdamW."""
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations.fsdp import dedicate
    from dmuon.optim import DMuon, param_groups

    if name == "adamw":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        decay = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
        ids = {id(p) for p in decay}
        rest = [p for p in model.parameters() if id(p) not in ids]
        groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest}]
        opt = torch.optim.AdamW(groups, lr=LR["adamw"], betas=(0.9, 0.95), weight_decay=0.0)
        return opt, None
    ded = dedicate(model, mesh)  # 1: every matrix gets an owner rank
    for block in model.blocks:  # 2: FSDP2 takes everything else
        fully_shard(block, mesh=mesh, ignored_params=ded.params)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    extra = {"ns_compute_dtype": "float32"} if device.type == "cpu" else {}
    opt = DMuon(  # 3: the optimizer
        param_groups(model),
        lr=LR["dmuon"],
        weight_decay=WEIGHT_DECAY,
        adamw_lr=LR["adamw"],
        distributed=ded,
        **extra,
    )
    return opt, ded


def _all_mean(value: torch.Tensor) -> float:
    import torch.distributed as dist

    value = value.detach().float().reshape(1).clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def rank_main(
    rank: int, world: int, settings: Settings, train: torch.Tensor, held_out: torch.Tensor
) -> dict[str, Any]:
    """Inside each rank: train with each optimizer in turn, return the curves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    s = settings
    device = torch.device(s.device, rank if s.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sampler = BatchSampler(train, s.size.global_batch, s.size.seq_len, seed=0)
    val = validation_batches(
        held_out, s.eval_batches, s.size.global_batch, s.size.seq_len, rank=rank, world_size=world
    )
    mesh = init_device_mesh(device.type, (world,))
    out: dict[str, Any] = {"runs": {}}

    def evaluate(model: GPT, ded: Any) -> float:
        if ded is not None:
            ded.wait()
        model.eval()
        with torch.no_grad():
            losses = [model.loss(x.to(device), y.to(device)) for x, y in val]
        model.train()
        return _all_mean(torch.stack(losses).mean())

    progress = _progress() if rank == 0 and s.show_progress else None
    for name in RUNS:
        model = GPT(s.size.gpt()).to(device)
        opt, ded = _optimizer(name, model, mesh, device)
        warmup = max(1, s.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t, w=warmup: lr_multiplier(t, s.steps, w, "cosine", 0.1)
        )
        curve: dict[str, list[float]] = {
            "train_loss": [],
            "step_seconds": [],
            "eval_steps": [0],
            "val_loss": [evaluate(model, ded)],
            "eval_seconds": [0.0],
        }
        task = progress.add_task(LABELS[name], total=s.steps, loss="") if progress else None
        elapsed = 0.0
        for t in range(s.steps):
            x, y = sampler.batch(t, rank=rank, world_size=world, device=device)
            t0 = time.perf_counter()
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            elapsed += seconds
            curve["train_loss"].append(_all_mean(loss))
            curve["step_seconds"].append(seconds)
            if (t + 1) % s.eval_every == 0 or t + 1 == s.steps:
                curve["eval_steps"].append(t + 1)
                curve["val_loss"].append(evaluate(model, ded))
                curve["eval_seconds"].append(elapsed)
            if progress is not None:
                progress.update(task, advance=1, loss=f"loss {curve['train_loss'][-1]:.3f}")
        if ded is not None:
            ded.wait()
        if not all(math.isfinite(v) for v in curve["train_loss"]):
            raise FloatingPointError(f"{name}: a non-finite training loss")
        if ded is not None:
            curve["mode"] = opt.mode
            curve["owned"] = list(ded.owned)
            curve["dedicated"] = list(ded.names)
        out["runs"][name] = curve
        dist.barrier()
    if progress is not None:
        progress.stop()
    return out


def _progress() -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    bar.start()
    return bar


def summarise(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Curves of rank 0; the step time is the slowest rank's, per step."""
    runs = per_rank[0]["runs"]
    for name, curve in runs.items():
        per_step = zip(*(r["runs"][name]["step_seconds"] for r in per_rank), strict=True)
        curve["step_seconds"] = [max(ts) for ts in per_step]
        if "owned" in curve:  # which rank stepped which matrix
            curve["owned"] = [r["runs"][name]["owned"] for r in per_rank]
        # the first step builds buffers and plans kernels: leave it out of the median
        steady = curve["step_seconds"][1:] or curve["step_seconds"]
        curve["median_step_seconds"] = statistics.median(steady)
        curve["final_val_loss"] = curve["val_loss"][-1]
    return runs


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    runs = result["runs"]
    steps = result["settings"]["steps"]
    marks = sorted({1, *(round(steps * f) for f in (0.25, 0.5, 0.75)), steps} - {0})
    table = Table(title=f"training loss (nats/byte), {result['world_size']} ranks")
    table.add_column("step", justify="right")
    for name in runs:
        table.add_column(LABELS[name], justify="right")
    for m in marks:
        table.add_row(str(m), *(f"{runs[n]['train_loss'][m - 1]:.3f}" for n in runs))
    table.add_row("validation", *(f"{runs[n]['final_val_loss']:.3f}" for n in runs), style="bold")
    table.add_row(
        "ms / step",
        *(f"{runs[n]['median_step_seconds'] * 1e3:.0f}" for n in runs),
        style="bold",
    )
    console.print(table)
    d, a = runs["dmuon"], runs["adamw"]
    gap = a["final_val_loss"] - d["final_val_loss"]
    console.print(
        f"DMuon's final validation loss is {abs(gap):.3f} nats/byte "
        f"{'below' if gap >= 0 else 'above'} AdamW's; its step takes "
        f"{d['median_step_seconds'] / a['median_step_seconds']:.2f}× AdamW's "
        "(median over steps, slowest rank)."
    )


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    for name, curve in result["runs"].items():
        steps = range(1, len(curve["train_loss"]) + 1)
        (line,) = axes[0].plot(steps, curve["train_loss"], lw=0.8, alpha=0.6, label=LABELS[name])
        axes[0].plot(
            curve["eval_steps"],
            curve["val_loss"],
            marker="o",
            ms=3,
            color=line.get_color(),
            label=f"{LABELS[name]}, validation",
        )
        axes[1].plot(
            curve["eval_seconds"],
            curve["val_loss"],
            marker="o",
            ms=3,
            color=line.get_color(),
            label=LABELS[name],
        )
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall-clock of rank 0 (s)")
    for ax in axes:
        ax.set_ylabel("loss (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    size = result["settings"]["size"]
    fig.suptitle(
        f"byte-level GPT {size['n_layer']}×{size['d_model']}, {result['world_size']} "
        f"{result['backend']} ranks, global batch {size['global_batch']}×{size['seq_len']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model and batch")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the size's)")
    p.add_argument("--eval-every", type=int, default=None, help="validation period in steps")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: N GPUs with NCCL when there are N, else N gloo processes on the CPU",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)
    size = SIZES[args.size]
    steps = args.steps if args.steps is not None else size.steps
    if args.world < 1:
        p.error(f"--world must be ≥ 1, got {args.world}")
    if steps < 1:
        p.error(f"--steps must be ≥ 1, got {steps}")
    if size.global_batch % args.world:
        p.error(
            f"the {args.size} size's global batch {size.global_batch} is not divisible by "
            f"--world {args.world}; use a world size that divides it"
        )
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.device_count() >= args.world else "cpu"
    if device == "cuda" and torch.cuda.device_count() < args.world:
        p.error(f"--device cuda --world {args.world} needs {args.world} GPUs")
    eval_every = args.eval_every or max(1, steps // 10)
    settings = Settings(size, steps, eval_every, args.eval_batches, device, not args.no_progress)

    # Read the corpus and import the heavy modules once, here: forked ranks inherit them.
    from torch.distributed import fsdp  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

    import dmuon.integrations.fsdp  # noqa: F401
    from dmuon.comm.testing import run_on_ranks

    corpus = load_corpus()
    backend = "nccl" if device == "cuda" else "gloo"
    print(
        f"training a byte-level GPT ({size.n_layer}×{size.d_model}) for {steps} steps on "
        f"{args.world} {backend} ranks with DMuon and with AdamW …",
        flush=True,
    )
    started = time.perf_counter()
    launch: dict[str, Any] = {"backend": backend, "timeout": args.timeout}
    if device == "cuda":
        launch["start_method"] = "spawn"
    per_rank = run_on_ranks(
        rank_main, args.world, args=(settings, corpus.train, corpus.val), **launch
    )
    result = {
        "world_size": args.world,
        "backend": backend,
        "settings": {
            "size": dataclasses.asdict(size),
            "steps": steps,
            "eval_every": eval_every,
            "eval_batches": args.eval_batches,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
        },
        "corpus": corpus.describe(),
        "runs": summarise(per_rank),
        "wall_seconds": time.perf_counter() - started,
        "meta": machine_info(device),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"demo-{device}-w{args.world}" + ("" if args.size == "small" else f"-{args.size}")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # `nox -s demo` installs it; a bare `python benchmarks/demo.py` may not
        print(f"wrote {args.out / (stem + '.json')} (no figure: pip install matplotlib)")
        return 0
    plot(result, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
