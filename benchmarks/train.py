"""Convergence benchmark: the same byte-level GPT trained with each optimizer.

Every optimizer gets the same model (same initial weights), the same batches in
the same order, the same warm-up + decay schedule and the same weight-decay and
parameter-split conventions (``benchmarks/common/optimizers.py``); only the update
of the hidden matrices differs. Each runs at its own learning rate, taken from
``--lr NAME=VALUE``, else from a short sweep (``--sweep``: a few learning rates
for a fraction of the budget, the best validation loss wins, the grid is
extended while the best sits at its edge), else from the committed table
``DEFAULT_LRS``. The embeddings, head and norms of the Muon-family runs use
``--scalar-lr``, else the table's AdamW learning rate — the same whichever
optimizers run. ``benchmarks/lr_grid.py`` runs a full-budget learning-rate grid
over every rule with 2 seeds at the best point of each.

The corpus is the running Python's standard library (``*.py``), held out by file
(``--data`` for any text file or folder). Validation loss is measured every
``--eval-every`` steps on a fixed set of held-out batches.

Outputs under ``benchmarks/results/`` (``--out``): ``train-<device>[-quick][-<tag>]``
``.json`` (curves, chosen lrs, sweep, config, machine, date) and PNGs of validation
loss against step and against training wall-clock (and the sweep). The summary
table gives, per optimizer, the fraction of AdamW's steps it needs to reach
AdamW's final validation loss (issue target: DMuon ``muon`` ≤ 70%).

    python benchmarks/train.py                           # all six, committed lrs
    python benchmarks/train.py --sweep                   # pick each lr first
    python benchmarks/train.py --optimizers adamw,torch_muon --lr adamw=3e-3
    python benchmarks/train.py --quick                   # smoke test, < 1 minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.data import BatchSampler, Corpus, load_corpus, validation_batches  # noqa: E402
from benchmarks.common.loop import Curve, train  # noqa: E402
from benchmarks.common.metrics import machine_info, steps_to_reach  # noqa: E402
from benchmarks.common.model import GPT, GPTConfig  # noqa: E402
from benchmarks.common.optimizers import (  # noqa: E402
    DEFAULT_OPTIMIZERS,
    DMuonUnavailableError,
    build_optimizer,
    lr_multiplier,
    parse_optimizer_name,
)
from benchmarks.common.plots import plot_sweep, plot_validation  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"

# Learning rates used without --sweep. adamw and torch_muon: picked by
# `python benchmarks/train.py --optimizers adamw,torch_muon --sweep` on 2 CPU cores
# (see docs/benchmarks/index.md). The dmuon:* entries are provisional — the
# RMS-matched scale of torch_muon's choice — until a sweep with dmuon-optim
# replaces them; a rule without an entry falls back to dmuon:muon's.
DEFAULT_LRS = {
    "adamw": 7.5e-4,
    "torch_muon": 2.4e-2,
    "dmuon:muon": 2.4e-2,
    "dmuon:normuon": 2.4e-2,
    "dmuon:dion3": 2.4e-2,
    "dmuon:sign_muon": 2.4e-2,
}
SWEEP_FACTORS = (0.5, 1.0, 2.0)
SWEEP_MAX_EXTENSIONS = 3
# The target: DMuon muon reaches AdamW's final validation loss in ≤ 70% of its steps.
TARGET_OPTIMIZER, BASELINE, TARGET_MAX_FRACTION = "dmuon:muon", "adamw", 0.70


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that defines a run, recorded in the JSON."""

    model: GPTConfig
    steps: int
    batch_size: int
    warmup: int
    decay: str
    final_lr_fraction: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    momentum: float
    clip: float
    eval_every: int
    val_batches: int
    data_seed: int
    val_seed: int
    sweep_steps: int
    device: str

    def schedule(self, steps: int) -> Callable[[int], float]:
        # A sweep's shorter run keeps the same shape: warm-up in proportion.
        warmup = min(steps - 1, round(self.warmup * steps / self.steps))

        def multiplier(step: int) -> float:
            return lr_multiplier(step, steps, warmup, self.decay, self.final_lr_fraction)

        return multiplier


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.quick:
        defaults = {
            "layers": 2,
            "d_model": 64,
            "heads": 2,
            "seq_len": 64,
            "steps": 40,
            "batch_size": 8,
            "eval_every": 10,
            "val_batches": 2,
            "sweep_steps": 12,
        }
    else:
        defaults = {
            "layers": 6,
            "d_model": 256,
            "heads": 4,
            "seq_len": 128,
            "steps": 400,
            "batch_size": 16,
            "eval_every": 25,
            "val_batches": 8,
            "sweep_steps": 0,
        }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    steps = args.steps
    sweep_steps = args.sweep_steps or max(10, steps // 3)
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    model = GPTConfig(
        seq_len=args.seq_len,
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
        qkv=args.qkv,
        norm=args.norm,
        positions=args.positions,
        tie_embeddings=args.tie_embeddings,
        seed=args.seed,
    )
    return Settings(
        model=model,
        steps=steps,
        batch_size=args.batch_size,
        warmup=warmup,
        decay=args.decay,
        final_lr_fraction=args.final_lr_fraction,
        weight_decay=args.weight_decay,
        betas=(args.beta1, args.beta2),
        eps=1e-8,
        momentum=0.95,
        clip=args.clip,
        eval_every=args.eval_every,
        val_batches=args.val_batches,
        data_seed=args.seed,
        val_seed=10_000 + args.seed,
        sweep_steps=sweep_steps,
        device=args.device,
    )


def progress() -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description:<30}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:>6} val {task.fields[val]:>6}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )


@dataclasses.dataclass
class Bench:
    """The data and display shared by every run of one invocation."""

    settings: Settings
    corpus: Corpus
    sampler: BatchSampler
    val: list[tuple[torch.Tensor, torch.Tensor]]
    bar: Any

    def run(
        self,
        name: str,
        lr: float,
        scalar_lr: float,
        steps: int,
        label: str,
        rule_options: dict[str, Any] | None = None,
    ) -> tuple[Curve, list[str]]:
        s = self.settings
        model = GPT(s.model).to(s.device)
        opt = build_optimizer(
            name,
            model,
            lr=lr,
            scalar_lr=scalar_lr,
            weight_decay=s.weight_decay,
            betas=s.betas,
            eps=s.eps,
            momentum=s.momentum,
            rule_options=rule_options,
        )
        opt.attach_schedule(s.schedule(steps))
        task = self.bar.add_task(label, total=steps, loss="", val="")

        def on_step(step: int, loss: float, val: float | None) -> None:
            fields = {"loss": f"{loss:.3f}"}
            if val is not None:
                fields["val"] = f"{val:.3f}"
            self.bar.update(task, advance=1, **fields)

        curve = train(
            model,
            opt,
            self.sampler,
            self.val,
            steps=steps,
            eval_every=min(s.eval_every, steps),
            clip=s.clip,
            on_step=on_step,
        )
        self.bar.update(task, completed=steps)
        # One line per run as well: a log file (no terminal) gets no live bars.
        outcome = "diverged" if curve.diverged else f"final val {curve.final_val_loss:.4f}"
        self.bar.console.print(f"{label}: {outcome}, {curve.train_seconds[-1]:.0f} s training")
        return curve, opt.notes


def sweep_lr(
    bench: Bench, name: str, center: float, scalar_lr: float | None
) -> tuple[float, list[dict[str, Any]]]:
    """Short runs at ``center × SWEEP_FACTORS``; extend the grid by the same ratio
    while the best lr sits at an edge (at most ``SWEEP_MAX_EXTENSIONS`` times)."""
    steps = bench.settings.sweep_steps
    points: dict[float, float] = {}

    def probe(lr: float) -> None:
        run_scalar = lr if scalar_lr is None else scalar_lr
        curve, _ = bench.run(name, lr, run_scalar, steps, f"sweep {name} lr={lr:.2e}")
        points[lr] = curve.final_val_loss

    for f in SWEEP_FACTORS:
        probe(center * f)
    ratio = SWEEP_FACTORS[-1] / SWEEP_FACTORS[-2]
    for _ in range(SWEEP_MAX_EXTENSIONS):
        best = min(points, key=lambda lr: points[lr])
        if best == max(points):
            probe(best * ratio)
        elif best == min(points):
            probe(best / ratio)
        else:
            break
    best = min(points, key=lambda lr: points[lr])
    if best in (min(points), max(points)):
        bench.bar.console.print(
            f"warning: {name}: the best sweep lr {best:.2e} is at the edge of the grid "
            f"after {SWEEP_MAX_EXTENSIONS} extensions; the optimum may lie beyond it"
        )
    return best, [{"lr": lr, "val_loss": v} for lr, v in sorted(points.items())]


def default_lr(name: str) -> tuple[float, str]:
    if name in DEFAULT_LRS:
        return DEFAULT_LRS[name], "table"
    return DEFAULT_LRS["dmuon:muon"], "table (dmuon:muon's entry)"


def preflight(names: list[str], skip_unavailable: bool) -> list[str]:
    """Build each optimizer on a tiny model first, so a missing dmuon.optim or a bad
    rule name fails in a second, not after the other optimizers have trained."""
    usable: list[str] = []
    skipped: dict[str, list[str]] = {}
    for name in names:
        try:
            build_optimizer(name, GPT(GPTConfig.tiny()), lr=1e-3, scalar_lr=1e-3)
        except DMuonUnavailableError as exc:
            if not skip_unavailable:
                raise SystemExit(f"error: {name}: {exc}") from exc
            skipped.setdefault(str(exc), []).append(name)
            continue
        except ValueError as exc:
            raise SystemExit(f"error: {name}: {exc}") from exc
        usable.append(name)
    for reason, which in skipped.items():
        print(f"skipping {', '.join(which)}: {reason}")
    if not usable:
        raise SystemExit("error: no optimizer left to run")
    return usable


def summarise(runs: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    baseline = runs.get(BASELINE)
    rows: dict[str, Any] = {}
    target_loss = baseline["curve"]["final_val_loss"] if baseline else None
    base_seconds = baseline["curve"]["train_seconds"][-1] if baseline else None
    for name, run in runs.items():
        c = run["curve"]
        n = len(c["train_loss"])
        row: dict[str, Any] = {
            "lr": run["lr"],
            "lr_source": run["lr_source"],
            "final_val_loss": c["final_val_loss"],
            "best_val_loss": min(c["val_loss"]),
            "train_seconds": c["train_seconds"][-1] if n else 0.0,
            "ms_per_step": 1e3 * c["train_seconds"][-1] / n if n else None,
            "optimizer_ms_per_step": 1e3 * c["optimizer_seconds"] / n if n else None,
            "diverged": c["diverged"],
        }
        if target_loss is not None and math.isfinite(target_loss):
            at_step = steps_to_reach(c["eval_steps"], c["val_loss"], target_loss)
            at_time = steps_to_reach(c["eval_seconds"], c["val_loss"], target_loss)
            row["steps_to_baseline_final"] = at_step
            row["fraction_of_baseline_steps"] = None if at_step is None else at_step / steps
            row["fraction_of_baseline_time"] = (
                None if at_time is None or not base_seconds else at_time / base_seconds
            )
        rows[name] = row
    target: dict[str, Any] = {
        "optimizer": TARGET_OPTIMIZER,
        "baseline": BASELINE,
        "max_fraction": TARGET_MAX_FRACTION,
    }
    frac = rows.get(TARGET_OPTIMIZER, {}).get("fraction_of_baseline_steps")
    if TARGET_OPTIMIZER not in rows or baseline is None:
        target["status"] = "not run"
    elif frac is None:
        target["status"] = "missed (never reached the baseline's final loss)"
    else:
        target["fraction"] = frac
        target["status"] = "met" if frac <= TARGET_MAX_FRACTION else "missed"
    return {"rows": rows, "target": target, "baseline_final_val_loss": target_loss}


def print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    meta, summary = result["meta"], result["summary"]
    table = Table(
        title=f"Byte-level GPT, {result['config']['steps']} steps on {meta['device']} "
        f"({meta['cpu'] if meta['device'] == 'cpu' else meta.get('gpu')}, "
        f"{meta['torch_threads']} threads)"
    )
    for h in (
        "optimizer",
        "lr",
        "from",
        "final val",
        "best val",
        "steps to AdamW final",
        "of AdamW steps",
        "of AdamW time",
        "ms/step",
        "opt ms/step",
    ):
        table.add_column(h, justify="left" if h in ("optimizer", "from") else "right")

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v:.0%}"

    for name, r in summary["rows"].items():
        table.add_row(
            name,
            f"{r['lr']:.2e}",
            r["lr_source"],
            "diverged" if r["diverged"] else f"{r['final_val_loss']:.4f}",
            f"{r['best_val_loss']:.4f}",
            "—"
            if r.get("steps_to_baseline_final") is None
            else f"{r['steps_to_baseline_final']:.0f}",
            pct(r.get("fraction_of_baseline_steps")),
            pct(r.get("fraction_of_baseline_time")),
            f"{r['ms_per_step']:.0f}" if r["ms_per_step"] else "—",
            f"{r['optimizer_ms_per_step']:.1f}" if r["optimizer_ms_per_step"] else "—",
        )
    Console(width=160).print(table)
    t = summary["target"]
    line = f"Target: {t['optimizer']} reaches {t['baseline']}'s final validation loss in ≤ "
    line += f"{t['max_fraction']:.0%} of its steps: {t['status']}"
    if "fraction" in t:
        line += f" ({t['fraction']:.0%})"
    print(line)
    for name, run in result["runs"].items():
        for note in run["notes"]:
            print(f"note: {name}: {note}")


def output_stem(args: argparse.Namespace) -> str:
    stem = f"train-{args.device}" + ("-quick" if args.quick else "")
    return stem + (f"-{args.tag}" if args.tag else "")


def write_outputs(
    result: dict[str, Any], out: pathlib.Path, stem: str, plots: bool
) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{stem}.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(json_path)  # a reader never sees half a file
    written = [json_path]
    if not plots:
        return written
    curves = {name: run["curve"] for name, run in result["runs"].items()}
    cfg = result["config"]
    title = (
        f"byte-level GPT {cfg['parameters'] / 1e6:.1f}M params, batch {cfg['batch_size']}×"
        f"{cfg['model']['seq_len']}, {result['meta']['device']} ({result['meta']['date']})"
    )
    for x in ("step", "time"):
        path = out / f"{stem}-val-vs-{x}.png"
        plot_validation(curves, path, x=x, title=title)
        written.append(path)
    if result["sweep"]:
        path = out / f"{stem}-sweep.png"
        chosen = {n: r["lr"] for n, r in result["runs"].items() if r["lr_source"] == "sweep"}
        plot_sweep(result["sweep"], chosen, path, title=f"lr sweep, {cfg['sweep_steps']} steps")
        written.append(path)
    return written


def parse_lr_overrides(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = -1.0
        if not sep or not math.isfinite(lr) or lr <= 0:
            raise SystemExit(f"error: --lr expects NAME=POSITIVE_FLOAT, got {item!r}")
        parse_optimizer_name(name)
        out[name] = lr
    return out


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--optimizers",
        default=",".join(DEFAULT_OPTIMIZERS),
        help="comma-separated: adamw, torch_muon, dmuon:<rule> (default: %(default)s)",
    )
    p.add_argument(
        "--lr",
        action="append",
        default=[],
        metavar="NAME=LR",
        help="learning-rate override, repeatable (wins over --sweep and the table)",
    )
    p.add_argument(
        "--scalar-lr",
        type=float,
        default=None,
        help="AdamW lr of embeddings/head/norms in Muon-family runs (default: the "
        "table's AdamW lr, whichever optimizers this invocation runs)",
    )
    p.add_argument("--sweep", action="store_true", help="pick each lr by a short sweep first")
    p.add_argument(
        "--sweep-steps",
        type=int,
        default=None,
        help="steps per sweep run (default: a third of --steps)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model and budget: a smoke test")
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="drop dmuon:* optimizers when dmuon.optim is missing instead of failing",
    )
    g = p.add_argument_group("budget and data")
    g.add_argument("--steps", type=int, default=None, help="training steps (default 400)")
    g.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 16)")
    g.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default 128)")
    g.add_argument("--eval-every", type=int, default=None, help="validation period (default 25)")
    g.add_argument(
        "--val-batches", type=int, default=None, help="fixed validation batches (default 8)"
    )
    g.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib)")
    g.add_argument("--pattern", default=None, help="file-name glob for --data folders")
    g.add_argument("--val-fraction", type=float, default=0.08, help="held-out share, by file")
    g.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=None, help="default 6")
    g.add_argument("--d-model", type=int, default=None, help="default 256")
    g.add_argument("--heads", type=int, default=None, help="default 4")
    g.add_argument("--qkv", choices=("fused", "separate"), default="fused")
    g.add_argument("--norm", choices=("rmsnorm", "layernorm"), default="rmsnorm")
    g.add_argument("--positions", choices=("rotary", "learned"), default="rotary")
    g.add_argument("--tie-embeddings", action="store_true")
    g = p.add_argument_group("schedule and regularisation (the same for every optimizer)")
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5%%)")
    g.add_argument("--decay", choices=("cosine", "linear"), default="cosine")
    g.add_argument("--final-lr-fraction", type=float, default=0.0)
    g.add_argument(
        "--weight-decay", type=float, default=0.1, help="decoupled, on the hidden matrices"
    )
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip, 0 = off")
    g = p.add_argument_group("machine and output")
    g.add_argument("--device", default="cpu")
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the cores this process may use)",
    )
    g.add_argument("--out", type=pathlib.Path, default=RESULTS)
    g.add_argument("--tag", default="", help="suffix of the output file names")
    g.add_argument("--no-plots", action="store_true", help="JSON only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    threads = args.threads or (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    )
    torch.set_num_threads(max(1, threads or 1))
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    for name in names:
        try:
            parse_optimizer_name(name)
        except ValueError as exc:
            raise SystemExit(f"error: --optimizers: {exc}") from exc
    if len(set(names)) != len(names):
        raise SystemExit(f"error: --optimizers lists a name twice: {names}")
    overrides = parse_lr_overrides(args.lr)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    names = preflight(names, args.skip_unavailable)
    # AdamW first: the summary measures every other run against its final loss.
    names.sort(key=lambda n: n != "adamw")

    t_load = time.perf_counter()
    corpus = load_corpus(args.data, val_fraction=args.val_fraction, pattern=args.pattern)
    print(
        f"corpus: {corpus.source} — {len(corpus.train_files)} train / {len(corpus.val_files)} "
        f"held-out files, {corpus.train.numel() / 1e6:.1f} MB / {corpus.val.numel() / 1e6:.2f} MB"
        f" ({corpus.split}, {time.perf_counter() - t_load:.1f} s)"
    )
    s = settings
    sampler = BatchSampler(corpus.train, s.batch_size, s.model.seq_len, s.data_seed)
    val = validation_batches(
        corpus.val, s.val_batches, s.batch_size, s.model.seq_len, seed=s.val_seed
    )
    n_params = GPT(s.model).num_parameters()
    print(
        f"model: {n_params / 1e6:.2f} M parameters; {s.steps} steps of "
        f"{s.batch_size}×{s.model.seq_len} bytes; {torch.get_num_threads()} threads"
    )
    result: dict[str, Any] = {
        "meta": {**machine_info(s.device), "argv": sys.argv[1:] if argv is None else argv},
        "config": {
            **{k: v for k, v in dataclasses.asdict(s).items() if k != "model"},
            "model": dataclasses.asdict(s.model),
            "parameters": n_params,
            "corpus": corpus.describe(),
            "optimizers": names,
            "sweep_factors": SWEEP_FACTORS,
        },
        "runs": {},
        "sweep": {},
    }
    stem = output_stem(args)
    with progress() as bar:
        bench = Bench(s, corpus, sampler, val, bar)
        # The scalar lr of the Muon-family runs is fixed per invocation: --scalar-lr, else
        # the table's AdamW entry, never AdamW's lr of this invocation (which made a rule's
        # result depend on whether AdamW ran, or was swept, first).
        scalar_lr = args.scalar_lr if args.scalar_lr is not None else DEFAULT_LRS["adamw"]
        for name in names:
            # None: the run's own lr (AdamW trains every parameter at one lr).
            fixed_scalar_lr = None if name == "adamw" else scalar_lr
            if name in overrides:
                lr, source = overrides[name], "override"
            elif args.sweep:
                center, _ = default_lr(name)
                lr, points = sweep_lr(bench, name, center, fixed_scalar_lr)
                result["sweep"][name] = points
                source = "sweep"
            else:
                lr, source = default_lr(name)
            run_scalar_lr = lr if fixed_scalar_lr is None else fixed_scalar_lr
            curve, notes = bench.run(name, lr, run_scalar_lr, s.steps, f"{name} lr={lr:.2e}")
            result["runs"][name] = {
                "lr": lr,
                "lr_source": source,
                "scalar_lr": run_scalar_lr,
                "notes": notes,
                "curve": curve.as_dict(),
            }
            result["summary"] = summarise(result["runs"], s.steps)
            write_outputs(result, args.out, stem, plots=False)  # keep what is done so far
    written = write_outputs(result, args.out, stem, plots=not args.no_plots)
    print_summary(result)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
