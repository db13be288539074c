"""``dmuon-plan``: the command line (also ``python -m dmuon.optim.planner``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from dmuon.optim.planner.config import PRESETS, ConfigError, load_model
from dmuon.optim.planner.profiles import (
    DEFAULT_INTRA,
    DEVICES,
    INTERCONNECTS,
    ClusterProfile,
    Link,
    load_device_profile,
)
from dmuon.optim.planner.report import format_report, plot_overhead, to_json
from dmuon.optim.planner.step_model import TrainingShape, predict
from dmuon.optim.planner.traffic import DMUON_MODES

__all__ = ["main", "parser"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


MIN_LINK_BANDWIDTH = 1e6
"""The slowest link ``--intra``/``--inter`` take, in bytes per second (1 MB/s)."""


def _link(spec: str, *, what: str) -> Link:
    """A preset name, or ``<number>[GB/s]`` for a custom bandwidth (bytes per second)."""
    if spec in INTERCONNECTS:
        return INTERCONNECTS[spec]
    text = spec.strip().lower()
    scale = 1.0
    for unit, factor in (("gb/s", 1e9), ("mb/s", 1e6)):
        if text.endswith(unit):
            text, scale = text[: -len(unit)].strip(), factor
    try:
        value = float(text) * scale
    except ValueError:
        raise ValueError(
            f"{what} {spec!r}: give a preset ({', '.join(INTERCONNECTS)}) or a bandwidth "
            "such as '200GB/s'"
        ) from None
    if 0 < value < MIN_LINK_BANDWIDTH:  # 0, negative, inf, NaN: Link names them
        raise ValueError(
            f"{what} {spec!r} is {value:g} B/s: give a bandwidth of at least 1MB/s (times "
            "at slower links overflow the model's figures)"
        )
    return Link("custom", value, source=f"{what} given on the command line")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``dmuon-plan``."""
    p = argparse.ArgumentParser(
        prog="dmuon-plan",
        description="Predict DMuon's step time, traffic and memory on a cluster.",
    )
    p.add_argument(
        "model",
        help=f"config.json path, 'module:factory', or a preset: {', '.join(PRESETS)}",
    )
    p.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8): dp × tp")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--device",
        default="H100",
        help=f"preset ({', '.join(DEVICES)}) or a profile JSON (--calibrate, gpu_check.py)",
    )
    p.add_argument("--intra", help="intra-node link: preset or bandwidth ('300GB/s')")
    p.add_argument("--inter", default="ib-ndr", help="inter-node link: preset or bandwidth")
    p.add_argument(
        "--tokens", type=int, default=4 * 1024 * 1024, help="global batch in tokens per step"
    )
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument(
        "--mode",
        default="all",
        help=f"one of {', '.join(DMUON_MODES)} or 'all' (comma-separated list allowed)",
    )
    p.add_argument("--mfu", type=float, default=0.4, help="MFU of forward+backward (0.4)")
    p.add_argument("--fwd-bwd-ms", type=float, help="measured forward+backward ms per step")
    p.add_argument("--ns-method", choices=("gram", "standard"), default="gram")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree T: a dp × tp mesh, dp = gpus/T"
    )
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree: expert stacks split over ep"
    )
    p.add_argument(
        "--tp-path",
        choices=("auto", "gram", "gather"),
        default="auto",
        help="how a split matrix is orthogonalised (auto: the cheaper by the cost model)",
    )
    p.add_argument(
        "--rule",
        default="muon",
        help="DMuon's matrix rule, for its optimizer state in the memory table (default muon)",
    )
    p.add_argument(
        "--state-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="dtype of the matrix rule's state (DMuon's state_dtype; default: the parameter's)",
    )
    p.add_argument(
        "--ns-compute-dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="Newton–Schulz compute dtype (DMuon's ns_compute_dtype), in which the tp Gram "
        "path's all-reduces travel (default float16, a GPU's for Gram Newton–Schulz)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (schema in the docs)")
    p.add_argument("--plot", metavar="PNG", help="write overhead vs GPUs (8 → 1024)")
    p.add_argument(
        "--calibrate",
        metavar="PROFILE_JSON",
        help="measure this machine (GEMM, NS on the model's shapes, AdamW, collectives) "
        "and write a device profile here",
    )
    p.add_argument(
        "--calibrate-device", choices=("cpu", "cuda"), default=None, help="default: cuda if any"
    )
    p.add_argument("--calibrate-world", type=int, default=2, help="ranks for the α–β fit")
    return p


def _modes(text: str) -> tuple[str, ...]:
    if text == "all":
        return DMUON_MODES
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in DMUON_MODES]
    if bad or not modes:
        raise ValueError(f"--mode must be 'all' or among {', '.join(DMUON_MODES)}, got {text!r}")
    return modes


def main(argv: list[str] | None = None) -> int:
    """Run ``dmuon-plan``; returns the exit status (2 for bad input, with the reason)."""
    args = parser().parse_args(argv)
    try:
        return _run(args)
    except (ConfigError, ValueError) as err:
        print(f"dmuon-plan: error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.plot:  # before the work, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'dmuon-optim[plan]'") from None
    if args.tokens < args.seq_len:
        raise ValueError(
            f"--tokens {args.tokens} is less than one sequence of --seq-len {args.seq_len}: "
            "give the global batch of a step in tokens (sequences × sequence length)"
        )
    spec = load_model(args.model, dtype=_DTYPES[args.dtype])
    if args.calibrate:
        from dmuon.optim.planner.calibrate import calibrate

        device = args.calibrate_device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _DTYPES[args.dtype] if device == "cuda" else torch.float32
        profile = calibrate(
            spec,
            device=device,
            dtype=dtype,
            link_world=args.calibrate_world,
            progress=lambda s: print(s, file=sys.stderr),
        )
        Path(args.calibrate).write_text(json.dumps(profile.to_json(), indent=1) + "\n")
        print(f"wrote {args.calibrate}", file=sys.stderr)
        args.device = args.calibrate
    device = load_device_profile(args.device)
    intra = _link(args.intra or DEFAULT_INTRA.get(device.name, "nvlink4"), what="--intra")
    link = device.measured.get("link") if isinstance(device.measured, dict) else None
    if link and not args.intra:
        intra = Link.from_fit(link)
    inter = _link(args.inter, what="--inter")
    cluster = ClusterProfile(device, args.gpus, args.gpus_per_node, intra, inter)
    shape = TrainingShape(
        global_tokens=args.tokens,
        seq_len=args.seq_len,
        mfu=args.mfu,
        fwd_bwd_s=None if args.fwd_bwd_ms is None else args.fwd_bwd_ms / 1e3,
        method=args.ns_method,
        ns_steps=args.ns_steps,
        tp=args.tp,
        ep=args.ep,
        tp_path=args.tp_path,
        rule=args.rule,
        state_dtype=args.state_dtype,
        ns_compute_dtype=args.ns_compute_dtype,
    )
    prediction = predict(spec, cluster, shape, modes=("adamw", "vanilla", *_modes(args.mode)))
    if args.plot:
        drawn = plot_overhead(prediction, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
        prediction = replace(prediction)
        curves = {m: [None if v != v else v for v in ys] for m, ys in drawn.items()}  # NaN
        plot_note = {"gpus": [8, 16, 32, 64, 128, 256, 512, 1024], "overhead": curves}
    else:
        plot_note = None
    if args.json:
        out = to_json(prediction)
        if plot_note is not None:
            out["overhead_curve"] = plot_note
        print(json.dumps(out, indent=1))
    else:
        print(format_report(prediction))
    return 0
