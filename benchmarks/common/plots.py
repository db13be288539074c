"""Figures of a convergence comparison (matplotlib, Agg backend, PNG files).

Example:
    >>> import pathlib, tempfile
    >>> from benchmarks.common.plots import plot_validation
    >>> runs = {"adamw": {"eval_steps": [0, 10], "eval_seconds": [0.0, 1.0],
    ...                   "val_loss": [5.5, 3.0]}}
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> plot_validation(runs, out / "by_step.png", x="step", title="demo")
    >>> (out / "by_step.png").stat().st_size > 0
    True
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping
from typing import Any

__all__ = ["plot_sweep", "plot_validation"]

_X = {"step": ("eval_steps", "step"), "time": ("eval_seconds", "training wall-clock (s)")}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_validation(
    runs: Mapping[str, Mapping[str, Any]],
    path: pathlib.Path,
    *,
    x: str = "step",
    title: str = "",
    reference: str | None = "adamw",
) -> None:
    """Validation loss of every run against ``x`` = ``"step"`` or ``"time"``.

    ``runs`` maps a label to a curve dict with ``eval_steps``, ``eval_seconds`` and
    ``val_loss`` (:meth:`benchmarks.common.loop.Curve.as_dict`). A dashed line marks
    the final validation loss of ``reference`` when it is present.

    Raises:
        ValueError: ``x`` is not ``"step"`` or ``"time"``.
    """
    if x not in _X:
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")
    key, xlabel = _X[x]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    finals, initial = [], 0.0
    for label, curve in runs.items():
        losses = [v if math.isfinite(v) else float("nan") for v in curve["val_loss"]]
        ax.plot(curve[key][: len(losses)], losses, marker=".", markersize=3, label=label)
        finite = [v for v in losses if math.isfinite(v)]
        if finite:
            finals.append(min(finite))
            initial = max(initial, finite[0])
    if reference is not None and reference in runs and runs[reference]["val_loss"]:
        target = runs[reference]["val_loss"][-1]
        if math.isfinite(target):
            ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
            ax.annotate(
                f"{reference} final {target:.3f}",
                (0.99, target),
                va="bottom",
                ha="right",
                xycoords=("axes fraction", "data"),
                fontsize=8,
                color="gray",
            )
    if finals:
        # The first evaluations (≈ ln 256 = 5.5 nats) would squash the interesting end.
        low = min(finals)
        ax.set_ylim(low - 0.05, min(initial, low + 1.2) + 0.05)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(
    sweeps: Mapping[str, list[Mapping[str, Any]]],
    chosen: Mapping[str, float],
    path: pathlib.Path,
    *,
    title: str = "",
) -> None:
    """Short-run validation loss against learning rate per optimizer; the chosen lr
    is circled. ``sweeps[name]`` is a list of ``{"lr": ..., "val_loss": ...}``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, points in sweeps.items():
        pts = sorted((p["lr"], p["val_loss"]) for p in points if math.isfinite(p["val_loss"]))
        if not pts:
            continue
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if name in chosen:
            best = [v for lr, v in pts if lr == chosen[name]]
            if best:
                ax.plot(
                    [chosen[name]],
                    best,
                    marker="o",
                    markersize=12,
                    fillstyle="none",
                    color=line.get_color(),
                )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation loss after the sweep budget")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
