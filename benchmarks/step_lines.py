"""The Python work of one training step against the depth of the model, per mode.

A step's work on the host must grow linearly with the number of layers: every
per-step decision made once per parameter (or once, at bind), never once per
parameter *and* layer. A scan of every parameter inside a per-layer loop does not
show in a small model's step time, and at 48 layers it is most of the step's
Python work. Counted, not timed: on 2 gloo ranks, for each setup of
:mod:`benchmarks.step_world` and each depth of its byte-level GPT, one warm-up step,
then :func:`sys.settrace` counts the Python *lines* executed in the ``dmuon``
packages during one full step (forward, backward with its hooks, ``opt.step()``,
``zero_grad``) and the next forward (whose pre-hooks wait for published weights).
Lines, not calls: a loop that calls nothing still counts.

Printed per setup: rank 0's lines at each depth and the lines each added layer
adds between consecutive depths; linear work adds the same at every depth.
``--json PATH`` writes them. The figures depend on the code, not on the machine.

    python benchmarks/step_lines.py
    python benchmarks/step_lines.py --setups owner_ddp sharded --depths 4 8 16 32
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from dmuon.comm.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402

#: the DMuon setups of ``benchmarks/step_world.py`` on a 1-D group of ranks (``muon_vanilla``
#: is ``mode="single"`` under DDP)
DMUON_SETUPS = (
    "owner_ddp",
    "owner_fsdp",
    "owner_ddp_zero1",
    "replicated",
    "sharded",
    "sign",
    "muon_vanilla",
)
DEPTHS = (4, 8, 16)


def _rank_main(rank: int, world: int, setup: str, n_layer: int, d_model: int) -> int:
    from benchmarks.step_files import source_path
    from benchmarks.step_world import WorldConfig, build

    cfg = WorldConfig(n_layer=n_layer, d_model=d_model, n_head=2, seq_len=8, batch_per_rank=1)
    torch.manual_seed(0)
    forward, opt, _ = build(setup, cfg, torch.device("cpu"))
    x = torch.randint(0, 256, (1, cfg.seq_len))

    def one_step() -> None:
        forward(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # warm-up: first-step work (state, plans, caches) is not counted
    lines = 0

    def count(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return count

    def enter(frame: Any, event: str, arg: Any) -> Any:
        # trace the frames of the dmuon packages' files only (not torch's, nor this
        # repository's benchmarks, wherever the checkout lies)
        return count if source_path(frame.f_code.co_filename) is not None else None

    sys.settrace(enter)
    threading.settrace(enter)
    try:
        one_step()
        forward(x)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return lines


def lines_per_step(
    setup: str, n_layer: int, *, world: int = 2, d_model: int = 32, timeout: float = 300.0
) -> list[int]:
    """Each rank's Python lines in ``dmuon`` during one warm step of ``setup``."""
    return run_on_ranks(
        _rank_main, world, args=(setup, n_layer, d_model), timeout=timeout, threads_per_rank=1
    )


def growth(lines: dict[int, int]) -> list[float]:
    """Lines added per added layer between consecutive depths.

    Examples:
        >>> growth({4: 100, 8: 180, 16: 340})
        [20.0, 20.0]
    """
    depths = sorted(lines)
    return [(lines[b] - lines[a]) / (b - a) for a, b in itertools.pairwise(depths)]


def measure(
    setups: Sequence[str] = DMUON_SETUPS,
    depths: Sequence[int] = DEPTHS,
    *,
    world: int = 2,
    d_model: int = 32,
    timeout: float = 300.0,
) -> dict[str, dict[int, int]]:
    """Rank 0's lines per step, by setup and depth."""
    return {
        setup: {
            n: lines_per_step(setup, n, world=world, d_model=d_model, timeout=timeout)[0]
            for n in depths
        }
        for setup in setups
    }


def table(result: dict[str, dict[int, int]]) -> str:
    depths = sorted(next(iter(result.values())))
    steps = [f"{a}→{b}" for a, b in itertools.pairwise(depths)]
    head = ["setup", *(f"lines at {n}" for n in depths), *(f"per layer {s}" for s in steps)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setup, lines in result.items():
        cells = [setup, *(str(lines[n]) for n in depths), *(f"{g:.1f}" for g in growth(lines))]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setups", nargs="+", default=list(DMUON_SETUPS), help="setups of step_world.py"
    )
    parser.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS), help="GPT blocks")
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo on CPU); default 2")
    parser.add_argument("--d-model", type=int, default=32, help="GPT width; default 32")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if len(args.depths) < 2:
        parser.error("--depths needs at least two depths to show the growth")
    print(f"counting one warm step's dmuon lines on {args.world} gloo ranks ...", flush=True)
    result = measure(
        args.setups, args.depths, world=args.world, d_model=args.d_model, timeout=args.timeout
    )
    print(table(result))
    if args.json is not None:
        out = {
            "world": args.world,
            "d_model": args.d_model,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            # the lines counted depend on the code and the versions, not on the machine:
            # the record says which commit and versions they are of
            "machine": machine_info("cpu", world_size=args.world, threads_per_rank=1),
            "lines": {s: {str(n): v for n, v in lines.items()} for s, lines in result.items()},
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
