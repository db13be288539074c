"""The ``dmuon`` source files one owner-mode step passes through, measured.

Two ranks (gloo on CPU processes), ``ddp.dedicate`` on the 2-layer byte-level GPT
of :mod:`benchmarks.common.model` and ``DMuon(distributed=...)``. After one
warm-up step, :func:`sys.setprofile` records every Python *call* event whose code
lives in one of the ``dmuon`` packages during one full step (forward,
backward with its hooks, ``opt.step()``, ``zero_grad``) and the next forward
(whose pre-hooks wait for the published weights). Counted per rank:

| figure | what it counts |
|---|---|
| files | distinct ``dmuon`` source files |
| hops | calls that land in a different file than the previous call |
| package crossings | hops that land in a different package |
| optimizer entries | hops into ``dmuon/optim/optimizer.py`` |

The figures depend on the code, not on the machine (no time is measured), so
``docs/development/architecture.md`` quotes them. Prints a table and the file
list per package; ``--json PATH`` writes the figures and the call sequence of
each rank.

    python benchmarks/step_files.py
    python benchmarks/step_files.py --json step-files.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
from typing import Any

import torch

from dmuon.comm.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common.metrics import machine_info  # noqa: E402

PACKAGES = ("kernels", "comm", "optim", "integrations")


def source_path(filename: str) -> str | None:
    """``dmuon/<package>/...`` for a file of one of the dmuon packages, else None.

    Works for a checkout (``packages/dmuon-*/src/dmuon/...``) and for installed
    distributions (``site-packages/dmuon/...``) alike.
    """
    path = pathlib.PurePath(filename).as_posix()
    for package in PACKAGES:
        marker = f"/dmuon/{package}/"
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1 :]
    return None


def _package(rel: str) -> str:
    return rel.split("/")[1]


def figures(sequence: list[str]) -> dict[str, Any]:
    """Files, hops, package crossings and optimizer entries of one call sequence.

    ``sequence`` lists the file of each call event, with repeats of the same file
    in a row already folded into one entry (a hop is a change of file).
    """
    files = sorted(set(sequence))
    crossings = sum(1 for a, b in itertools.pairwise(sequence) if _package(a) != _package(b))
    entries = sum(1 for f in sequence if f == "dmuon/optim/optimizer.py")
    by_package = {p: [f for f in files if _package(f) == p] for p in PACKAGES}
    return {
        "files": len(files),
        "hops": max(len(sequence) - 1, 0),
        "package_crossings": crossings,
        "optimizer_entries": entries,
        "files_by_package": by_package,
        "sequence": sequence,
    }


def _rank_main(rank: int, world: int, n_layer: int, d_model: int) -> dict[str, Any]:
    from benchmarks.common.model import GPT, GPTConfig
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, d_model=d_model, n_head=4, seq_len=16, seed=0))
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, lr=1e-3)
    x = torch.randint(0, 256, (2, 16))

    def one_step() -> None:
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # warm-up: first-step work (state, plans, caches) is not counted
    sequence: list[str] = []

    def record(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        rel = source_path(frame.f_code.co_filename)
        if rel is not None and (not sequence or sequence[-1] != rel):
            sequence.append(rel)

    sys.setprofile(record)
    try:
        one_step()
        model(x)  # the next forward: its pre-hooks wait for the published weights
    finally:
        sys.setprofile(None)
    return figures(sequence)


def measure(
    *, world: int = 2, n_layer: int = 2, d_model: int = 64, timeout: float = 300.0
) -> list[dict[str, Any]]:
    """The figures of each rank, in rank order."""
    return run_on_ranks(
        _rank_main, world, args=(n_layer, d_model), timeout=timeout, threads_per_rank=1
    )


def table(ranks: list[dict[str, Any]]) -> str:
    head = "| rank | files | hops | package crossings | entries into optimizer.py |"
    rows = [head, "|---|---|---|---|---|"]
    for rank, r in enumerate(ranks):
        row = (r["files"], r["hops"], r["package_crossings"], r["optimizer_entries"])
        rows.append(f"| {rank} | " + " | ".join(map(str, row)) + " |")
    return "\n".join(rows)


def file_lists(ranks: list[dict[str, Any]]) -> str:
    lines = []
    for package in PACKAGES:
        files = sorted({f for r in ranks for f in r["files_by_package"][package]})
        lines.append(f"{package} ({len(files)}):")
        lines.extend(f"  {f}" for f in files)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo on CPU); default 2")
    parser.add_argument("--layers", type=int, default=2, help="GPT blocks; default 2")
    parser.add_argument("--d-model", type=int, default=64, help="GPT width; default 64")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before the ranks are stopped",
    )
    parser.add_argument(
        "--json",
        type=pathlib.Path,
        default=None,
        help="write the figures of each rank here",
    )
    args = parser.parse_args(argv)
    print(f"recording one warm owner-mode step on {args.world} gloo ranks ...", flush=True)
    ranks = measure(
        world=args.world, n_layer=args.layers, d_model=args.d_model, timeout=args.timeout
    )
    print(table(ranks))
    print()
    print("files per package (union over ranks):")
    print(file_lists(ranks))
    if args.json is not None:
        result = {
            "world": args.world,
            "layers": args.layers,
            "d_model": args.d_model,
            "torch": torch.__version__,
            # what is counted depends on the code and versions: the record names them
            "machine": machine_info("cpu", world_size=args.world, threads_per_rank=1),
            "ranks": ranks,
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
