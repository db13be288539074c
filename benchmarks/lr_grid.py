"""A fair learning-rate grid over every update rule, AdamW and ``torch.optim.Muon``.

Every optimizer trains the byte-level GPT of ``benchmarks/train.py`` — same model,
same initial weights, same batches in the same order, same warm-up + decay schedule,
same budget — at each learning rate of a log-spaced grid (``--points`` points,
``--ratio`` apart, centred on ``--center``), for the *full* budget (not a shortened
sweep). While the best learning rate sits at an edge of its grid, the grid is
extended by one point on that side (at most ``--max-extensions`` times). The best
point is then rerun with every seed of ``--seeds`` (a seed changes the initial
weights and the data order; the validation batches stay fixed).

Reported per optimizer: the best learning rate and its ratio to AdamW's best (the
question ``adjust_lr="match_rms_adamw"`` is meant to answer: does AdamW's learning
rate carry over?), the final validation loss at it (every seed, and their mean),
the steps it needs to reach AdamW's final loss (seed 0), and the wall-clock per step.

An optimizer name is ``adamw``, ``torch_muon`` or ``dmuon:<rule>``, optionally with
rule options after ``+``: ``dmuon:musec+clip_mode=soft`` is soft Musec as a line of
its own. The embeddings, head and norms of every non-AdamW run are trained by AdamW
at ``--scalar-lr`` (fixed, so that a rule's result does not depend on what else ran).

The JSON (``benchmarks/results/train-grid-<tag>.json``) is rewritten after every run
and read back on the next invocation with the same configuration: runs already in
it are not repeated, so a long grid can be stopped, resumed, or extended with more
optimizers. PNGs: validation loss against step and against training time at each
optimizer's best learning rate (seed 0), one line per optimizer, and loss against
learning rate (the grid).

    python benchmarks/lr_grid.py --layers 4 --d-model 128 --seq-len 64 --steps 150 --tag l4d128
    python benchmarks/lr_grid.py ...same configuration... --report --markdown   # summary only
    python benchmarks/lr_grid.py --quick --out /tmp/grid          # seconds
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
from benchmarks.common.grid_runs import Grid, open_grid, run_key  # noqa: E402
from benchmarks.common.metrics import machine_info, steps_to_reach  # noqa: E402
from benchmarks.common.model import GPT  # noqa: E402
from benchmarks.common.optimizers import parse_optimizer_name  # noqa: E402
from benchmarks.common.plots import plot_sweep, plot_validation  # noqa: E402
from benchmarks.train import Bench, Settings, progress, settings_from_args  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
RULES = (
    "muon",
    "normuon",
    "adamuon",
    "muon2",
    "mona",
    "musec",
    "sign_muon",
    "dion2",
    "dion3",
    "muonbp",
    "numuon",
    "scion",
)
DEFAULT_OPTIMIZERS = (
    "adamw",
    "torch_muon",
    *(f"dmuon:{r}" for r in RULES),
    "dmuon:musec+clip_mode=soft",
)
BASELINE = "adamw"
# Grid centres: AdamW's lr, and ten times it for the matrix rules under
# match_rms_adamw (the previous sweeps' finding, which this grid checks).
DEFAULT_CENTERS = {"adamw": 10**-2.5}
DEFAULT_MATRIX_CENTER = 10**-1.5


def parse_name(spec: str) -> tuple[str, dict[str, Any]]:
    """``"dmuon:musec+clip_mode=soft"`` → ``("dmuon:musec", {"clip_mode": "soft"})``.

    A value is read as an int, else a float, else ``true``/``false``/``none``, else
    kept as a string.

    Raises:
        ValueError: a bad optimizer name, options on ``adamw``/``torch_muon``, or an
            option without ``=``.

    Examples:
        >>> parse_name("dmuon:musec+clip_mode=soft+clip_tau=2")
        ('dmuon:musec', {'clip_mode': 'soft', 'clip_tau': 2})
    """
    name, *items = spec.split("+")
    kind, _ = parse_optimizer_name(name)
    if items and kind != "dmuon":
        raise ValueError(f"only dmuon:<rule> takes options after '+', got {spec!r}")
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"rule option {item!r} in {spec!r} is not KEY=VALUE")
        options[key] = _value(raw)
    return name, options


def _value(raw: str) -> Any:
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(raw.lower(), raw)


def grid(center: float, points: int, ratio: float) -> list[float]:
    """``points`` learning rates ``ratio`` apart, log-centred on ``center``.

    Raises:
        ValueError: ``points < 2``, ``ratio <= 1`` or ``center <= 0``.

    Examples:
        >>> [f"{lr:.3g}" for lr in grid(1e-2, 5, 10**0.5)]
        ['0.001', '0.00316', '0.01', '0.0316', '0.1']
    """
    if points < 2 or not ratio > 1 or not center > 0:
        raise ValueError(
            f"grid needs points >= 2, ratio > 1 and center > 0; got {points}, {ratio}, {center}"
        )
    return [center * ratio ** (i - (points - 1) / 2) for i in range(points)]


def best_lr(points: dict[float, float]) -> float:
    """The lr of the lowest final validation loss (a diverged run counts as +∞)."""
    return min(sorted(points), key=lambda lr: points[lr])


def next_extension(points: dict[float, float], ratio: float) -> float | None:
    """The lr one step beyond the edge where the best sits, or ``None`` (best inside).

    Examples:
        >>> next_extension({1.0: 3.0, 2.0: 2.0}, 2.0)
        4.0
        >>> next_extension({1.0: 3.0, 2.0: 2.0, 4.0: 2.5}, 2.0) is None
        True
    """
    best = best_lr(points)
    if best == max(points):
        return best * ratio
    if best == min(points):
        return best / ratio
    return None


def grid_gap(
    points: dict[float, float], n_points: int, max_extensions: int, seeds_at_best: int, seeds: int
) -> str | None:
    """What an optimizer's grid still lacks, or ``None`` when it is complete.

    Complete means what :func:`search` and the seed reruns leave behind: at least
    ``n_points`` seed-0 points; the best inside them unless ``max_extensions``
    extensions were already spent at an edge; every seed run at the best lr. The best
    point of an incomplete grid is not final (a later point may beat it).

    Examples:
        >>> grid_gap({1.0: 3.0, 2.0: 2.0}, 5, 2, 1, 2)
        '2 of 5 points'
        >>> grid_gap({1.0: 3.0, 2.0: 2.0, 4.0: 2.5}, 3, 2, 1, 2)
        'seeds 1 of 2 at the best lr'
        >>> grid_gap({1.0: 3.0, 2.0: 2.0, 4.0: 1.5}, 3, 2, 2, 2)
        'best at the edge, 0 of 2 extensions run'
        >>> grid_gap({1.0: 3.0, 2.0: 2.0, 4.0: 2.5}, 3, 2, 2, 2) is None
        True
    """
    if len(points) < n_points:
        return f"{len(points)} of {n_points} points"
    extensions = len(points) - n_points
    if next_extension(points, 10.0) is not None and extensions < max_extensions:
        return f"best at the edge, {extensions} of {max_extensions} extensions run"
    if seeds_at_best < seeds:
        return f"seeds {seeds_at_best} of {seeds} at the best lr"
    return None


def fitted_lr(points: dict[float, float]) -> float | None:
    """The vertex of the parabola through the best point and its two neighbours, in
    log lr — a sharper estimate of the optimum than the grid's spacing; ``None`` when
    the best sits at an edge or the three points do not curve upwards.

    Examples:
        >>> round(fitted_lr({0.1: 3.0, 1.0: 2.0, 10.0: 3.0}), 6)
        1.0
        >>> fitted_lr({1.0: 3.0, 2.0: 2.0}) is None
        True
    """
    lrs = sorted(lr for lr in points if math.isfinite(points[lr]))
    best = best_lr(points)
    if best not in lrs or best in (lrs[0], lrs[-1]):
        return None
    i = lrs.index(best)
    (x0, x1, x2), (y0, y1, y2) = (
        [math.log(v) for v in lrs[i - 1 : i + 2]],
        [points[v] for v in lrs[i - 1 : i + 2]],
    )
    # divided differences: y = y1 + b(x − x1) + c(x − x0)(x − x1)…, vertex at −B/2C
    c = ((y2 - y1) / (x2 - x1) - (y1 - y0) / (x1 - x0)) / (x2 - x0)
    if not c > 0:
        return None
    b = (y1 - y0) / (x1 - x0) - c * (x0 + x1)
    return math.exp(-b / (2 * c))


@dataclasses.dataclass
class Runner:
    """Runs (or reuses) one training run per ``(optimizer, lr, seed)``."""

    grid: Grid
    settings: Settings
    benches: dict[int, Bench]
    scalar_lr: float

    def run(self, spec: str, lr: float, seed: int) -> float:
        if (old := self.grid.done(spec, lr, seed)) is not None:
            return float(old["curve"]["final_val_loss"])
        name, options = parse_name(spec)
        scalar = lr if name == "adamw" else self.scalar_lr
        bench = self.benches[seed]
        label = f"{spec} lr={lr:.2e} seed {seed}"
        curve, notes = bench.run(name, lr, scalar, self.settings.steps, label, options)
        self.grid.add(
            spec,
            lr,
            seed,
            {
                "scalar_lr": scalar,
                "rule_options": options,
                "notes": notes,
                "curve": curve.as_dict(),
            },
        )
        return curve.final_val_loss


def search(runner: Runner, spec: str, center: float, args: argparse.Namespace) -> float:
    """Full-budget runs over the grid (seed 0), extended at an edge; the best lr.

    Extensions already in the file (a resumed grid) count towards ``--max-extensions``.
    """
    base = grid(center, args.points, args.ratio)
    for lr in base:
        runner.run(spec, lr, 0)
    known = {f"{lr:.6g}" for lr in base}
    while sum(f"{lr:.6g}" not in known for lr in runner.grid.points(spec)) < args.max_extensions:
        beyond = next_extension(runner.grid.points(spec), args.ratio)
        if beyond is None:
            break
        runner.run(spec, beyond, 0)
    return best_lr(runner.grid.points(spec))


def summarise(
    result: dict[str, Any], specs: list[str], seeds: list[int], max_extensions: int
) -> dict[str, Any]:
    """One row per optimizer. A row whose grid is incomplete (:func:`grid_gap`) has
    ``complete: false`` and its gap under ``incomplete``; its ``best_lr`` is the best so
    far, and no ratio to AdamW or steps to AdamW's loss is computed from it (nor for
    any optimizer while AdamW's own grid is incomplete)."""
    runs = result["runs"]
    steps = result["config"]["steps"]

    def pick(name: str, lr: float, seed: int) -> dict[str, Any] | None:
        return runs.get(run_key(name, lr, seed))

    rows: dict[str, Any] = {}
    for spec in specs:
        pts = {
            r["lr"]: r["curve"]["final_val_loss"]
            for r in runs.values()
            if r["optimizer"] == spec and r["seed"] == 0
        }
        if not pts:
            continue
        lr = best_lr(pts)
        finals = [
            r["curve"]["final_val_loss"] for s in seeds if (r := pick(spec, lr, s)) is not None
        ]
        timed = [r for r in runs.values() if r["optimizer"] == spec and r["curve"]["train_loss"]]
        ms = [1e3 * r["curve"]["train_seconds"][-1] / len(r["curve"]["train_loss"]) for r in timed]
        opt_ms = [
            1e3 * r["curve"]["optimizer_seconds"] / len(r["curve"]["train_loss"]) for r in timed
        ]
        gap = grid_gap(pts, result["config"]["points"], max_extensions, len(finals), len(seeds))
        rows[spec] = {
            "complete": gap is None,
            "incomplete": gap,
            "best_lr": lr,
            "fitted_lr": fitted_lr(pts),
            "grid": [{"lr": k, "val_loss": pts[k]} for k in sorted(pts)],
            "best_at_edge": lr in (min(pts), max(pts)),
            "final_val_loss_by_seed": finals,
            "final_val_loss_mean": statistics.fmean(finals) if finals else None,
            "ms_per_step": statistics.median(ms) if ms else None,
            "optimizer_ms_per_step": statistics.median(opt_ms) if opt_ms else None,
        }
    base = rows.get(BASELINE)
    if base is not None and base["complete"]:
        base_run = pick(BASELINE, base["best_lr"], 0)
        target = base_run["curve"]["final_val_loss"] if base_run else None
        for spec, row in rows.items():
            if not row["complete"]:
                continue
            row["lr_ratio_to_adamw"] = row["best_lr"] / base["best_lr"]
            if row["fitted_lr"] and base["fitted_lr"]:
                row["fitted_lr_ratio_to_adamw"] = row["fitted_lr"] / base["fitted_lr"]
            run = pick(spec, row["best_lr"], 0)
            if target is None or run is None or not math.isfinite(target):
                continue
            c = run["curve"]
            at = steps_to_reach(c["eval_steps"], c["val_loss"], target)
            row["steps_to_adamw_final"] = at
            row["fraction_of_adamw_steps"] = None if at is None else at / steps
    return {"rows": rows, "seeds": seeds}


def _cells(spec: str, r: dict[str, Any]) -> dict[str, str]:
    """The table's cells of one summary row; an incomplete grid says what it lacks
    and shows its best point so far as such, never as a result."""
    pts = r["grid"]
    span = f"{pts[0]['lr']:.2g}…{pts[-1]['lr']:.2g} ({len(pts)})"
    at = r.get("steps_to_adamw_final")
    if not r.get("complete", True):
        so_far = min(p["val_loss"] for p in pts)
        return {
            "best lr": f"incomplete: {r['incomplete']}",
            "ratio": "—",
            "fitted": "—",
            "grid": f"{span}, best so far {so_far:.3f} at {r['best_lr']:.2g}",
            "seeds": "—",
            "mean": "—",
            "steps": "—",
            "ms": "—" if r["ms_per_step"] is None else f"{r['ms_per_step']:.0f}",
        }
    fitted = "—"
    if r.get("fitted_lr"):
        fitted = f"{r['fitted_lr']:.2g}"
        if "fitted_lr_ratio_to_adamw" in r:
            fitted += f" ({r['fitted_lr_ratio_to_adamw']:.3g})"
    return {
        "best lr": f"{r['best_lr']:.2g}",
        "ratio": f"{r['lr_ratio_to_adamw']:.3g}" if "lr_ratio_to_adamw" in r else "—",
        "fitted": fitted,
        "grid": span + (", best at an edge" if r["best_at_edge"] else ""),
        "seeds": " / ".join(f"{v:.3f}" for v in r["final_val_loss_by_seed"]),
        "mean": "—" if r["final_val_loss_mean"] is None else f"{r['final_val_loss_mean']:.3f}",
        "steps": "—"
        if "lr_ratio_to_adamw" not in r
        else ("not reached" if at is None else f"{at:.0f}"),
        "ms": "—" if r["ms_per_step"] is None else f"{r['ms_per_step']:.0f}",
    }


_HEADERS = {
    "best lr": "best lr",
    "ratio": "÷ AdamW's",
    "fitted": "fitted lr (÷ AdamW's)",
    "grid": "grid (seed 0)",
    "seeds": "final val, seeds 0 / 1",
    "mean": "mean",
    "steps": "steps to AdamW's final",
    "ms": "ms/step",
}


def incomplete_note(result: dict[str, Any]) -> str | None:
    """A sentence naming the optimizers whose grids are incomplete, or ``None``."""
    rows = result["summary"]["rows"]
    names = [f"`{s}` ({r['incomplete']})" for s, r in rows.items() if not r["complete"]]
    missing = [s for s in result["config"]["optimizers"] if s not in rows]
    parts = []
    if names:
        parts.append("incomplete grids, their best point not final: " + ", ".join(names))
    if missing:
        parts.append("not started: " + ", ".join(f"`{s}`" for s in missing))
    return "; ".join(parts) if parts else None


def print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg, meta = result["config"], result["meta"]
    table = Table(
        title=f"lr grid: {cfg['model']['n_layer']}×{cfg['model']['d_model']} byte-level GPT, "
        f"{cfg['steps']} steps, batch {cfg['batch_size']}×{cfg['model']['seq_len']}, "
        f"{meta['device']} ({meta.get('cpu') or meta.get('gpu')}, {meta['torch_threads']} threads)"
    )
    table.add_column("optimizer")
    for key, h in _HEADERS.items():
        table.add_column(h, justify="left" if key in ("grid", "best lr") else "right")
    for spec, r in result["summary"]["rows"].items():
        table.add_row(spec, *_cells(spec, r).values())
    console = Console(width=190)
    console.print(table)
    if (note := incomplete_note(result)) is not None:
        console.print(note[0].upper() + note[1:] + ".")


def markdown_table(result: dict[str, Any]) -> str:
    """The summary as a Markdown table (the docs' benchmarks page); a line after it
    names the incomplete grids and the optimizers not started."""
    lines = [
        "| optimizer | " + " | ".join(_HEADERS.values()) + " |",
        "|---" * (len(_HEADERS) + 1) + "|",
    ]
    for spec, r in result["summary"]["rows"].items():
        lines.append(f"| `{spec}` | " + " | ".join(_cells(spec, r).values()) + " |")
    if (note := incomplete_note(result)) is not None:
        lines += ["", note[0].upper() + note[1:] + "."]
    return "\n".join(lines)


def write_plots(result: dict[str, Any], stem: pathlib.Path) -> list[pathlib.Path]:
    # An incomplete grid's line is labelled so: its best point so far is not final.
    rows = {
        spec + ("" if r["complete"] else " (incomplete)"): r
        for spec, r in result["summary"]["rows"].items()
    }
    curves = {
        label: result["runs"][run_key(label.split(" ")[0], r["best_lr"], 0)]["curve"]
        for label, r in rows.items()
    }
    cfg = result["config"]
    title = (
        f"{cfg['model']['n_layer']}×{cfg['model']['d_model']} GPT "
        f"({cfg['parameters'] / 1e6:.2f}M), best lr of each, {result['meta']['device']} "
        f"({result['meta']['date']})"
    )
    written = []
    for x in ("step", "time"):
        path = stem.with_name(f"{stem.name}-val-vs-{x}.png")
        plot_validation(curves, path, x=x, title=title, reference=BASELINE)
        written.append(path)
    path = stem.with_name(f"{stem.name}-lr.png")
    plot_sweep(
        {spec: r["grid"] for spec, r in rows.items()},
        {spec: r["best_lr"] for spec, r in rows.items()},
        path,
        title=f"final validation loss after {cfg['steps']} steps against lr",
    )
    written.append(path)
    return written


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS))
    p.add_argument("--points", type=int, default=5, help="grid points per optimizer")
    p.add_argument("--ratio", type=float, default=10**0.5, help="ratio of neighbouring lrs")
    p.add_argument(
        "--center",
        action="append",
        default=[],
        metavar="NAME=LR",
        help=f"grid centre, repeatable (default: adamw {DEFAULT_CENTERS['adamw']:.3g}, "
        f"others {DEFAULT_MATRIX_CENTER:.3g})",
    )
    p.add_argument("--max-extensions", type=int, default=2, help="extra points at an edge")
    p.add_argument("--seeds", default="0,1", help="seeds of the best point (seed 0 runs the grid)")
    p.add_argument("--scalar-lr", type=float, default=3e-3, help="AdamW lr of non-matrix params")
    p.add_argument("--quick", action="store_true", help="tiny model and budget: seconds")
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing: summarise the JSON of this configuration, print, plot",
    )
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument(
        "--resume",
        action="store_true",
        help="add to the JSON of this tag: its runs are not repeated (the configuration\n"
        "must equal the file's; a difference is refused, naming the field)",
    )
    p.add_argument(
        "--rerun",
        default="",
        metavar="OPTS",
        help="with --resume: comma-separated optimizers whose runs in the file are moved\n"
        "to 'superseded' and run again (each must also be in --optimizers)",
    )
    g = p.add_argument_group("model and budget (as benchmarks/train.py)")
    for flag in (
        "--steps",
        "--batch-size",
        "--seq-len",
        "--eval-every",
        "--val-batches",
        "--layers",
        "--d-model",
        "--heads",
        "--warmup",
    ):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--out", type=pathlib.Path, default=RESULTS)
    g.add_argument("--tag", default="", help="suffix of the output file names")
    g.add_argument("--no-plots", action="store_true")
    return p


def train_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments ``benchmarks/train.py`` would have got (its defaults elsewhere)."""
    from benchmarks.train import make_parser as train_parser

    ns = train_parser().parse_args([])
    for key in (
        "quick",
        "steps",
        "batch_size",
        "seq_len",
        "eval_every",
        "val_batches",
        "layers",
        "d_model",
        "heads",
        "warmup",
        "data",
        "device",
    ):
        setattr(ns, key, getattr(args, key))
    return ns


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    specs = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    try:
        for spec in specs:
            parse_name(spec)
        seeds = [int(s) for s in args.seeds.split(",")]
        centers = {}
        for item in args.center:
            name, _, value = item.rpartition("=")  # a name may hold "=": musec+clip_tau=0.5
            centers[name] = float(value)
        grid(1.0, args.points, args.ratio)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    rerun = [s.strip() for s in args.rerun.split(",") if s.strip()]
    if rerun and not args.resume:
        raise SystemExit("error: --rerun replaces runs of a grid file: it needs --resume")
    if stray := [s for s in rerun if s not in specs]:
        raise SystemExit(
            f"error: --rerun names {', '.join(stray)}, not in --optimizers ({', '.join(specs)})"
        )
    if seeds[0] != 0:
        raise SystemExit(f"error: --seeds must start with 0 (the grid's seed), got {args.seeds}")
    if BASELINE in specs:  # AdamW first: the others are measured against it
        specs.remove(BASELINE)
        specs.insert(0, BASELINE)
    tns = train_namespace(args)
    settings = settings_from_args(tns)
    corpus = load_corpus(args.data, val_fraction=tns.val_fraction, pattern=None)
    val = validation_batches(
        corpus.val,
        settings.val_batches,
        settings.batch_size,
        settings.model.seq_len,
        seed=settings.val_seed,
    )
    n_params = GPT(settings.model).num_parameters()
    config = {
        **{k: v for k, v in dataclasses.asdict(settings).items() if k != "model"},
        "model": dataclasses.asdict(settings.model),
        "parameters": n_params,
        "scalar_lr": args.scalar_lr,
        "points": args.points,
        "ratio": args.ratio,
        "corpus": corpus.describe(),
        "optimizers": specs,
    }
    config = json.loads(json.dumps(config))  # tuples → lists, as read back
    stem = args.out / (
        "train-grid-"
        + args.device
        + ("-quick" if args.quick else "")
        + (f"-{args.tag}" if args.tag else "")
    )
    path = stem.with_suffix(".json")
    meta = {**machine_info(settings.device), "argv": sys.argv[1:] if argv is None else argv}
    grid_file = open_grid(
        path,
        {"meta": meta, "config": config},
        resume=args.resume,
        rerun=rerun,
        report=args.report,
    )
    result = grid_file.result
    config = result["config"]
    print(
        f"model: {n_params / 1e6:.2f} M parameters; {settings.steps} steps of "
        f"{settings.batch_size}×{settings.model.seq_len} bytes; {torch.get_num_threads()} threads; "
        f"{len(result['runs'])} runs already in {path.name}"
    )
    t0 = time.perf_counter()
    if args.report:
        if not result["runs"]:
            raise SystemExit(f"error: --report: no runs in {path}")
        specs = []  # run nothing; the summary covers every optimizer in the file
    with progress() as bar:
        benches = {}
        for seed in seeds:
            s = dataclasses.replace(
                settings, model=dataclasses.replace(settings.model, seed=seed), data_seed=seed
            )
            sampler = BatchSampler(corpus.train, s.batch_size, s.model.seq_len, seed)
            benches[seed] = Bench(s, corpus, sampler, val, bar)
        runner = Runner(grid_file, settings, benches, args.scalar_lr)
        for spec in specs:
            center = centers.get(spec, DEFAULT_CENTERS.get(spec, DEFAULT_MATRIX_CENTER))
            lr = search(runner, spec, center, args)
            for seed in seeds[1:]:
                runner.run(spec, lr, seed)
            result["summary"] = summarise(result, config["optimizers"], seeds, args.max_extensions)
            runner.grid.write()
    result["summary"] = summarise(result, config["optimizers"], seeds, args.max_extensions)
    if not args.report:  # a report never writes the file (a grid may be writing it)
        grid_file.write()
    print_summary(result)
    if args.markdown:
        print(markdown_table(result))
    written = ([] if args.report else [path]) + ([] if args.no_plots else write_plots(result, stem))
    print(f"{time.perf_counter() - t0:.0f} s")
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
