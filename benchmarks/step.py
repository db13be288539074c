"""Optimizer step time: DMuon (every rule) vs torch.optim.Muon vs AdamW (foreach).

``--single``: one process. For the weight-matrix shapes of GPT-2 small and of a
Llama-style 1B model (scaled down on CPU so a 2-core machine finishes in
minutes), gradients are filled with random numbers once and ``optimizer.step()``
alone is timed (median of interleaved rounds). Reported:

* ms per step and the ratio to ``torch.optim.Muon`` and to AdamW (foreach);
* the target of issue 5: DMuon ``muon`` at *equal coefficients* (Keller's,
  5 steps — what torch.optim.Muon runs) ≤ 0.6× torch.optim.Muon's step on CPU.
  The gain comes from stacking same-shape matrices into one batched call and
  from Gram Newton–Schulz on rectangular matrices.

``--world N``: the whole training step of the byte-level GPT on N ranks (gloo
on CPU, one thread per rank; NCCL on N GPUs), split into forward, backward,
communication wait and optimizer, for AdamW (DDP, FSDP2), vanilla distributed
Muon and DMuon in each execution mode (``benchmarks/step_world.py``), with
ratios to AdamW and to vanilla Muon and the targets of issue 6 (DMuon
optimizer step ≤ 0.55× vanilla's; DMuon step ≤ 1.15× AdamW's where vanilla's
is ≥ 1.5×; plan imbalance ≤ 5%).

Writes ``benchmarks/results/step-single-<device>[-quick][-dry-run][-<N>thread][-<tag>].json``
(or ``step-world<N>-<device>[-quick][-b<B>][-tp|-dp-tp][-<tag>].json``) and ``.png`` and
prints a table.
Nothing here asserts on time.

    python benchmarks/step.py --single            # full run on the default device
    python benchmarks/step.py --single --quick    # a smaller, faster subset
    python benchmarks/step.py --single --threads 1   # steadier on a shared machine (-1thread files)
    python benchmarks/step.py --world 2           # 2 ranks: every setup, phases per step
    python benchmarks/step.py --world 4 --quick   # a small model, a few steps
    python benchmarks/step.py --single --threads 1 --rules muon --tag bf16   # ...-1thread-bf16

The load average before and after is stored with the results: on a shared
machine, compare ratios, not milliseconds. On a CPU ``--single`` also records each
step's CPU time (``time.process_time``; with ``--threads 1`` the work done, which other
jobs' load inflates far less than the wall clock) and prints the ratios of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import file_tag, machine_info  # noqa: E402
from benchmarks.common.progress import progress  # noqa: E402
from dmuon.kernels import ns_flops  # noqa: E402
from dmuon.optim import RULES, DMuon  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Config:
    """The hidden weight matrices of a model: (label, (out, in), count per layer) × layers."""

    name: str
    layers: int
    matrices: tuple[tuple[str, tuple[int, int], int], ...]

    def shapes(self) -> list[tuple[int, int]]:
        return [s for _ in range(self.layers) for _, s, c in self.matrices for _ in range(c)]

    def summary(self) -> str:
        per = ", ".join(f"{c}×{s[0]}x{s[1]} {n}" for n, s, c in self.matrices)
        return f"{self.name}: {self.layers} layers of [{per}]"


# GPT-2 small (d=768): fused qkv, attention out, MLP in/out — nn.Linear (out, in) shapes.
GPT2 = (
    ("qkv", (2304, 768), 1),
    ("attn out", (768, 768), 1),
    ("fc", (3072, 768), 1),
    ("proj", (768, 3072), 1),
)
# Llama-3.2-1B (d=2048, ffn 8192, 32 q heads / 8 kv heads of 64): q, k, v, o, gate, up, down.
LLAMA1B = (
    ("q", (2048, 2048), 1),
    ("k,v", (512, 2048), 2),
    ("o", (2048, 2048), 1),
    ("gate,up", (8192, 2048), 2),
    ("down", (2048, 8192), 1),
)


def scaled(matrices, div: int):
    return tuple((n, (a // div, b // div), c) for n, (a, b), c in matrices)


# --dry-run: every code path at toy sizes (benchmarks/gpu_run.py runs it on a CPU in CI).
TINY = (("qkv", (96, 32), 1), ("fc", (128, 32), 1), ("proj", (32, 128), 1))


def configs(device: str, quick: bool, dry_run: bool = False) -> list[Config]:
    if dry_run:
        return [Config("tiny (dry run)", 2, TINY)]
    if device == "cuda":
        return [Config("gpt2-small", 12, GPT2), Config("llama-1b", 16, LLAMA1B)]
    if quick:
        return [
            Config("gpt2-small (2 layers)", 2, GPT2),
            Config("llama-1b /8 width", 4, scaled(LLAMA1B, 8)),
        ]
    # CPU: GPT-2 small at full width, 4 of its 12 layers; Llama-1B at a quarter of its
    # width and all 16 layers (1024-wide hidden states would take minutes per step).
    return [
        Config("gpt2-small (4 of 12 layers)", 4, GPT2),
        Config("llama-1b /4 width", 16, scaled(LLAMA1B, 4)),
    ]


KELLER = dict(ns_coefficients="keller", ns_method="gram", ns_steps=5)
EQUAL_MATH = "DMuon muon, Keller, standard NS"  # what torch.optim.Muon computes
DEFAULT = "DMuon muon"  # Gram Newton–Schulz, Polar Express
TORCH_MUON = "torch.optim.Muon"
TORCH_MUON_FP32 = "torch.optim.Muon, NS in fp32"


def ns_dtype(device: str) -> torch.dtype:
    """The dtype of the equal-math comparison (issue 18): torch.optim.Muon's own bf16 where
    the matmuls are native (CUDA, CPUs with bf16 units), fp32 on other CPUs, whose emulated
    bf16 matmul is tens of times slower than fp32 (DMuon picks fp32 there too)."""
    if device == "cuda":
        return torch.bfloat16
    from dmuon.kernels import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def _zeropower_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch 2.13's ``torch.optim._muon._zeropower_via_newtonschulz`` (Keller Jordan's
    iteration) with its cast to bf16 replaced by fp32: the same operators in the same
    order, so the comparison with DMuon in fp32 is at equal math and equal dtype."""
    a, b, c = ns_coefficients
    X = grad.float()
    if grad.size(0) > grad.size(1):
        X = X.T
    X.div_(X.norm().clamp(min=eps))
    for _ in range(ns_steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    if grad.size(0) > grad.size(1):
        X = X.T
    return X


class TorchMuonFP32(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton–Schulz runs in fp32 (see :func:`_zeropower_fp32`)."""

    @torch.no_grad()
    def step(self, closure=None):
        import torch.optim._muon as impl

        original = impl._zeropower_via_newtonschulz
        impl._zeropower_via_newtonschulz = _zeropower_fp32
        try:
            return super().step(closure)
        finally:
            impl._zeropower_via_newtonschulz = original


def optimizers(
    rules: list[str], device: str = "cpu", emulated_bf16: bool = False
) -> list[tuple[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]]:
    """The optimizers of ``--single``. Where the comparison runs in fp32 (a CPU without bf16
    units) torch.optim.Muon's own bf16 step is left out unless ``emulated_bf16``: its
    emulated bf16 matmuls took 264 s for one step of 2 GPT-2 layers on one thread."""
    dtype = str(ns_dtype(device)).removeprefix("torch.")
    out: list[tuple[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]] = [
        ("AdamW (foreach)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
    ]
    if ns_dtype(device) == torch.bfloat16 or emulated_bf16:
        out.append((TORCH_MUON, lambda ps: torch.optim.Muon(ps, lr=0.02, adjust_lr_fn="original")))
    if ns_dtype(device) == torch.float32:
        out.append(
            (TORCH_MUON_FP32, lambda ps: TorchMuonFP32(ps, lr=0.02, adjust_lr_fn="original"))
        )
    out += [
        (
            "DMuon muon, Keller coefficients",
            lambda ps: DMuon(ps, rule="muon", ns_compute_dtype=dtype, **KELLER),
        ),
        (
            EQUAL_MATH,
            lambda ps: DMuon(
                ps,
                rule="muon",
                ns_coefficients="keller",
                ns_method="standard",
                ns_compute_dtype=dtype,
            ),
        ),
    ]
    for rule in rules:
        out.append((f"DMuon {rule}", lambda ps, rule=rule: DMuon(ps, rule=rule)))
    return out


@dataclasses.dataclass
class Row:
    config: str
    optimizer: str
    matrices: int
    parameters: int
    seconds: float  # median over rounds
    all_seconds: list[float]
    # CPU time of the process during the step (``time.process_time``), median over rounds:
    # with one torch thread on a shared machine, the work done, which other jobs' load
    # inflates far less than the wall clock. Recorded for CPU runs only.
    cpu_seconds: float | None = None
    all_cpu_seconds: list[float] | None = None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every optimizer steps the same parameters; steps are timed in interleaved rounds.

    Round r times one step of every optimizer in turn, so background load that
    drifts during the run (other jobs on a shared machine) hits every optimizer
    alike; the median over rounds is reported.
    """
    rows: list[Row] = []
    cfgs = configs(args.device, args.quick, args.dry_run)
    opts = optimizers(args.rules, args.device, args.emulated_bf16)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with progress(width=48) as bar:
        task = bar.add_task("step", total=len(cfgs) * len(opts) * (args.rounds + 1))
        for cfg in cfgs:
            gen = torch.Generator().manual_seed(0)
            params = [
                torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(args.device))
                for s in cfg.shapes()
            ]
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(args.device)
            # On a CPU the rounds interleave every optimizer (background load hits all
            # alike). On a GPU (a dedicated device) the optimizers run one after another
            # and each is freed with its CUDA graphs before the next: sixteen optimizers'
            # state at Llama-1B size does not fit in an H200's memory at once.
            groups = [opts] if args.device != "cuda" else [[o] for o in opts]
            times: dict[str, list[float]] = {}
            cpu_times: dict[str, list[float]] = {}
            for group in groups:
                built = []
                for label, make in group:
                    bar.update(task, description=f"{cfg.name[:20]}: warm-up {label[:26]}")
                    opt = make(params)
                    opt.step()  # first-call allocations
                    sync()
                    built.append((label, opt))
                    times[label] = []
                    cpu_times[label] = []
                    bar.advance(task)
                for r in range(args.rounds):
                    for label, opt in built:
                        text = f"{cfg.name[:20]}: round {r + 1} {label[:22]}"
                        bar.update(task, description=text)
                        sync()
                        c0, t0 = time.process_time(), time.perf_counter()
                        opt.step()
                        sync()
                        times[label].append(time.perf_counter() - t0)
                        cpu_times[label].append(time.process_time() - c0)
                        bar.advance(task)
                del built, opt
                if args.device == "cuda":
                    from dmuon.kernels import release_cuda_graphs

                    release_cuda_graphs()
                    torch.cuda.empty_cache()
            n = sum(p.numel() for p in params)
            for label, ts in times.items():
                cs = cpu_times[label] if args.device == "cpu" else None
                cpu = statistics.median(cs) if cs else None
                row = Row(cfg.name, label, len(params), n, statistics.median(ts), ts, cpu, cs)
                rows.append(row)
            del params
    return {
        "meta": {
            **machine_info(args.device),
            "equal_math_dtype": str(ns_dtype(args.device)).removeprefix("torch."),
            "shared_machine": args.shared_machine,
        },
        "configs": [c.summary() for c in cfgs],
        "rounds": args.rounds,
        "rows": [dataclasses.asdict(r) for r in rows],
        "summary": summarise(rows, cfgs),
    }


def flop_ratio(cfg: Config) -> float:
    """Gram / standard Newton–Schulz FLOPs over the config's matrices (``ns_flops``).

    With the same coefficients, this bounds what Gram NS alone can save; the rest
    has to come from batching, which pays only where matrices are too small to
    keep the cores busy on their own.
    """
    gram = sum(ns_flops(m, n, method="gram") for m, n in cfg.shapes())
    return gram / sum(ns_flops(m, n, method="standard") for m, n in cfg.shapes())


def summarise(rows: list[Row], cfgs: list[Config]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    flops = {c.name: flop_ratio(c) for c in cfgs}
    for cfg in dict.fromkeys(r.config for r in rows):
        by = {r.optimizer: r.seconds for r in rows if r.config == cfg}
        cpu = {r.optimizer: r.cpu_seconds for r in rows if r.config == cfg}
        adamw = by["AdamW (foreach)"]
        # torch.optim.Muon in the dtype of the comparison (fp32 on CPUs without bf16 units)
        reference = by.get(TORCH_MUON_FP32) or by[TORCH_MUON]
        muon = by.get(TORCH_MUON, reference)
        out[cfg] = {
            "dmuon_keller_over_torch_muon": by["DMuon muon, Keller coefficients"] / muon,
            "dmuon_keller_standard_over_torch_muon": by[EQUAL_MATH] / muon,
            "equal_math_reference": TORCH_MUON_FP32 if TORCH_MUON_FP32 in by else TORCH_MUON,
            "torch_muon_bf16_timed": TORCH_MUON in by,
            "equal_math_over_torch_muon": by[EQUAL_MATH] / reference,
            "target_equal_math_over_torch_muon": 1.0,
            "default_over_torch_muon": by[DEFAULT] / reference if DEFAULT in by else None,
            "target_default_over_torch_muon": 0.75,
            "gram_over_standard_flops": flops[cfg],
            "target_dmuon_over_torch_muon": 0.6,
            "over_torch_muon": {k: v / muon for k, v in by.items()},
            "over_adamw": {k: v / adamw for k, v in by.items()},
        }
        if all(v is not None for v in cpu.values()):
            ref_cpu = cpu.get(TORCH_MUON_FP32) or cpu[TORCH_MUON]
            out[cfg]["cpu_time"] = {
                "equal_math_over_torch_muon": cpu[EQUAL_MATH] / ref_cpu,
                "default_over_torch_muon": cpu[DEFAULT] / ref_cpu if DEFAULT in cpu else None,
                "over_torch_muon": {k: v / ref_cpu for k, v in cpu.items()},
            }
    return out


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    for cfg, summ in result["summary"].items():
        table = Table(title=f"{cfg} — optimizer step on {result['meta']['device']}")
        cpu = summ.get("cpu_time")
        heads = ["optimizer", "ms / step", "× torch Muon", "× AdamW"]
        heads += ["CPU ms / step", "CPU × torch Muon"] if cpu else []
        for h in heads:
            table.add_column(h, justify="left" if h == "optimizer" else "right")
        for r in result["rows"]:
            if r["config"] != cfg:
                continue
            name = r["optimizer"]
            cells = [
                name,
                f"{r['seconds'] * 1e3:.1f}",
                f"{summ['over_torch_muon'][name]:.2f}",
                f"{summ['over_adamw'][name]:.1f}",
            ]
            if cpu:
                cells += [f"{r['cpu_seconds'] * 1e3:.1f}", f"{cpu['over_torch_muon'][name]:.2f}"]
            table.add_row(*cells)
        console.print(table)
        ratio = summ["dmuon_keller_over_torch_muon"]
        verdict = "met" if ratio <= 0.6 else "NOT met"
        console.print(
            f"DMuon muon / torch.optim.Muon at equal (Keller) coefficients: {ratio:.2f}× "
            f"(target ≤ 0.60×: {verdict}); with standard NS: "
            f"{summ['dmuon_keller_standard_over_torch_muon']:.2f}×; "
            f"Gram/standard NS FLOPs of these shapes: {summ['gram_over_standard_flops']:.2f}"
        )
        equal, default = summ["equal_math_over_torch_muon"], summ["default_over_torch_muon"]
        line = (
            f"issue 18, against {summ['equal_math_reference']} "
            f"({result['meta']['equal_math_dtype']}): equal math {equal:.2f}× "
            f"(target ≤ 1.00×: {'met' if equal <= 1.0 else 'NOT met'})"
        )
        if default is not None:
            line += f"; DMuon default {default:.2f}× (≤ 0.75×: "
            line += f"{'met' if default <= 0.75 else 'NOT met'})"
        if cpu:
            line += f"; in CPU time: equal math {cpu['equal_math_over_torch_muon']:.2f}×"
            if cpu["default_over_torch_muon"] is not None:
                line += f", default {cpu['default_over_torch_muon']:.2f}×"
        console.print(line + "\n")


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = list(result["summary"])
    fig, axes = plt.subplots(1, len(cfgs), figsize=(7 * len(cfgs), 5.5), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs, strict=True):
        rows = [r for r in result["rows"] if r["config"] == cfg]
        names = [r["optimizer"] for r in rows]
        ms = [r["seconds"] * 1e3 for r in rows]
        colors = [
            "tab:gray"
            if n.startswith("AdamW")
            else "tab:red"
            if n.startswith("torch")
            else "tab:blue"
            for n in names
        ]
        ax.barh(range(len(rows)), ms, color=colors)
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per optimizer step (log)")
        ax.set_title(
            f"{cfg}\n{result['meta']['device']}, torch threads = {result['meta']['torch_threads']}",
            fontsize=9,
        )
        reference = result["summary"][cfg]["equal_math_reference"]
        muon = next(r["seconds"] * 1e3 for r in rows if r["optimizer"] == reference)
        ax.axvline(muon, color="tab:red", lw=0.8, ls="--", label=reference)
        ax.axvline(0.75 * muon, color="tab:green", lw=0.8, ls=":", label="0.75 × that")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_world(args: argparse.Namespace) -> int:
    """``--world N``: the distributed training step (see ``benchmarks/step_world.py``)."""
    from benchmarks import step_world

    if args.world < 1:
        raise SystemExit(f"--world must be ≥ 1, got {args.world}")
    setups = args.setups or list(step_world.DEFAULT_SETUPS)
    unknown = sorted(set(setups) - set(step_world.SETUPS))
    if unknown:
        raise SystemExit(f"--setups: unknown {unknown}; choose from {list(step_world.SETUPS)}")
    cfg = step_world.QUICK if args.quick else step_world.WorldConfig()
    if args.batch_per_rank is not None:
        cfg = dataclasses.replace(cfg, batch_per_rank=args.batch_per_rank)
    steps = args.steps or (3 if args.quick else 6)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = step_world.run_world(
        args.world,
        setups=setups,
        cfg=cfg,
        steps=steps,
        warmup=1,
        device=args.device,
        timeout=args.timeout,
    )
    # the ranks' threads, not this launcher's (torch's default here: one per core)
    result["meta"] = machine_info(
        args.device, world_size=args.world, threads_per_rank=step_world.THREADS_PER_RANK
    )
    result["meta"]["load_average_1min"] = {
        "before": load_before,
        "after": result.pop("load_average_1min"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"step-world{args.world}-{args.device}" + ("-quick" if args.quick else "")
    if args.batch_per_rank is not None:
        stem += f"-b{args.batch_per_rank}"
    if set(setups) <= set(step_world.TP_SETUPS):  # the tensor-parallel comparison on its own
        stem += "-tp"
    elif set(setups) <= set(step_world.DP_TP_SETUPS):  # the dp × tp comparison on its own
        stem += "-dp-tp"
    stem += args.tag
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    step_world.plot(result, args.out / f"{stem}.png")
    step_world.print_table(result)
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--single", action="store_true", help="one process: optimizer step only")
    mode.add_argument(
        "--world", type=int, metavar="N", help="N ranks: the whole training step per mode"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="smaller models, shorter runs")
    p.add_argument(
        "--dry-run", action="store_true", help="--single: toy shapes, one round (checks the code)"
    )
    p.add_argument("--rounds", type=int, default=5, help="timed steps per optimizer (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rules", nargs="*", default=sorted(RULES), help="DMuon rules to time")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument(
        "--emulated-bf16",
        action="store_true",
        help="--single: also time torch.optim.Muon's bf16 step on a CPU without bf16 units",
    )
    p.add_argument(
        "--shared-machine",
        action="store_true",
        help="--single: record that other jobs shared the machine during the run",
    )
    p.add_argument(
        "--setups",
        nargs="*",
        default=None,
        help="--world: the setups to run (default: all but torch_muon_ddp, whose bf16 "
        "Newton–Schulz takes minutes per step on a CPU without bf16 matmul units, and the "
        "tensor-parallel ones, a comparison of their own: adamw_tp muon_tp_gather tp_single; "
        "and adamw_dp_tp muon_dp_tp_gather dp_tp_single dp_tp_replicated adamw_fsdp_tp "
        "fsdp_tp_sharded fsdp_tp_sharded_gram fsdp_tp_sharded_gather owner_dp_tp_gram "
        "owner_dp_tp_gather on a dp × tp mesh)",
    )
    p.add_argument("--steps", type=int, default=None, help="--world: timed steps (default 6)")
    p.add_argument(
        "--batch-per-rank",
        type=int,
        default=None,
        help="--world: sequences per rank (default 4; more tokens shrink the optimizer's share)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="--world: seconds for the run")
    p.add_argument(
        "--tag",
        type=file_tag,
        default="",
        help="suffix of the result files: --single --threads 1 --tag bf16 writes "
        "step-single-<device>-1thread-bf16.json",
    )
    args = p.parse_args(argv)
    if args.world is not None:
        return main_world(args)
    if args.quick:
        args.rounds = min(args.rounds, 3)
    if args.dry_run:
        args.rounds = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = run(args)
    result["meta"]["load_average_1min"] = {
        "before": load_before,
        "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"step-single-{args.device}" + ("-quick" if args.quick else "")
    stem += "-dry-run" if args.dry_run else ""
    if args.threads is not None:
        stem += f"-{args.threads}thread"
    stem += args.tag
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / f"{stem}.png")
    print_table(result)
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
