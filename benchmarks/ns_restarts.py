"""Where the Gram Newton–Schulz restart goes, per compute dtype: accuracy side by side.

For each compute dtype (fp16, bf16, fp32), spectrum and shape, runs
:func:`dmuon.kernels.orthogonalize` (``method="gram"``, Polar Express, five steps)
with the default restarts (:func:`dmuon.kernels.ns_options.default_restarts`) and
with ``(2,)``, ``(3,)``, ``(2, 4)`` and ``()``, and reports over three seeds the
largest top singular value of the result and the largest relative Frobenius
distance from the exact map ``U φ(Σ) Vᵀ`` (float64 SVD and
:func:`dmuon.kernels.ns_scalar_map`). One and two restarts cost the same whatever
their place; what differs is how far rounding carries the result from the map.

Spectra: ``gauss`` (i.i.d. entries), ``spread3`` / ``spread6`` (singular values
logarithmic over 3 / 6 decades, as a low-rank-dominated momentum has them),
``lowrank`` (rank 8). Prints a table, writes JSON (``--json``) and a PNG
(``--png``). No time is measured. CPU bf16 arithmetic is exact in torch whether
or not the CPU has native bf16 (the flag is recorded all the same).

    python benchmarks/ns_restarts.py --json benchmarks/results/ns-restarts-cpu.json \\
        --png benchmarks/results/ns-restarts-cpu.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import torch

from dmuon.kernels import ns_scalar_map, orthogonalize

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(ROOT))

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CHOICES: dict[str, tuple[int, ...] | None] = {
    "default": None,
    "(2,)": (2,),
    "(3,)": (3,),
    "(2, 4)": (2, 4),
    "()": (),
}
SPECTRA = ("gauss", "spread3", "spread6", "lowrank")
SHAPES = ((256, 256), (256, 1024))


def matrix(kind: str, m: int, n: int, seed: int) -> torch.Tensor:
    """A float64 test matrix of the named spectrum."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(m, n, generator=g, dtype=torch.float64)
    if kind == "lowrank":
        a = torch.randn(m, 8, generator=g, dtype=torch.float64)
        return a @ torch.randn(8, n, generator=g, dtype=torch.float64)
    decades = {"spread3": 3, "spread6": 6}[kind]
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return (U * torch.logspace(0, -decades, k, dtype=torch.float64)) @ V.mT


def exact_map(G: torch.Tensor) -> torch.Tensor:
    """``U φ(Σ) Vᵀ`` of the Frobenius-normalised ``G`` in float64."""
    U, S, Vh = torch.linalg.svd(G / torch.linalg.matrix_norm(G), full_matrices=False)
    return (U * ns_scalar_map("polar_express", S, 5)) @ Vh


def measure(seeds: int = 3) -> list[dict[str, Any]]:
    rows = []
    for dname, dtype in DTYPES.items():
        for kind in SPECTRA:
            for m, n in SHAPES:
                for cname, restarts in CHOICES.items():
                    top, dist = 0.0, 0.0
                    for seed in range(seeds):
                        G = matrix(kind, m, n, seed)
                        O = orthogonalize(
                            G.float(), method="gram", compute_dtype=dtype, restarts=restarts
                        ).double()
                        top = max(top, torch.linalg.svdvals(O).max().item())
                        want = exact_map(G)
                        dist = max(dist, (torch.linalg.norm(O - want) / want.norm()).item())
                    rows.append(
                        {
                            "dtype": dname,
                            "spectrum": kind,
                            "shape": [m, n],
                            "restarts": cname,
                            "top_singular_value": top,
                            "distance_from_map": dist,
                        }
                    )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = "| dtype | spectrum | shape | " + " | ".join(f"top σ {c}" for c in CHOICES) + " |"
    out = [head, "|" + "---|" * (3 + len(CHOICES))]
    keyed = {(r["dtype"], r["spectrum"], tuple(r["shape"]), r["restarts"]): r for r in rows}
    for dname in DTYPES:
        for kind in SPECTRA:
            for shape in SHAPES:
                cells = [
                    f"{keyed[(dname, kind, shape, c)]['top_singular_value']:.3f}" for c in CHOICES
                ]
                size = f"{shape[0]}×{shape[1]}"
                out.append(f"| {dname} | {kind} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide = [r for r in rows if r["shape"] == [256, 1024]]
    fig, axes = plt.subplots(1, len(DTYPES), figsize=(4 * len(DTYPES), 3.4), sharey=True)
    for ax, dname in zip(axes, DTYPES, strict=True):
        for i, cname in enumerate(CHOICES):
            tops = [
                next(r["top_singular_value"] for r in wide
                     if r["dtype"] == dname and r["spectrum"] == k and r["restarts"] == cname)
                for k in SPECTRA
            ]  # fmt: skip
            xs = [j + (i - 2) * 0.16 for j in range(len(SPECTRA))]
            ax.bar(xs, [min(t, 2.0) for t in tops], width=0.16, label=cname)
        ax.set_xticks(range(len(SPECTRA)), SPECTRA)
        ax.set_title(f"{dname}, 256×1024")
        ax.axhline(1.13, color="grey", lw=0.8, ls="--")
    axes[0].set_ylabel("top singular value (clipped at 2)")
    axes[-1].legend(title="restarts", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="matrices per cell; default 3")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the rows here")
    parser.add_argument("--png", type=pathlib.Path, default=None, help="write the plot here")
    args = parser.parse_args(argv)
    from benchmarks.common import machine_info

    rows = measure(args.seeds)
    print(table(rows))
    if args.json is not None:
        result = {"machine": machine_info("cpu"), "seeds": args.seeds, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.png is not None:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
