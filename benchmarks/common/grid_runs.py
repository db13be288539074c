"""The runs of a learning-rate grid as one JSON file that a later invocation resumes.

A run is keyed by ``optimizer|lr|seed``. The file holds the configuration the runs
were made under (model, budget, batches, data, schedule...), and a later invocation
may add runs to it only under the same configuration: :func:`config_differences`
names every field that differs. ``--rerun`` moves an optimizer's runs to
``superseded`` (kept, with the invocation that made them, so that old and new can be
compared from the file) and runs them again. Every invocation that wrote to the file
is listed under ``invocations`` (date, git commit, argv); each run records the index
of the one that made it (a run without ``invocation`` predates the list: index 0).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

__all__ = ["Grid", "comparable", "config_differences", "open_grid", "run_key"]


def run_key(name: str, lr: float, seed: int) -> str:
    """``"dmuon:muon|0.0316228|0"``: six significant digits, as stored in the file."""
    return f"{name}|{lr:.6g}|{seed}"


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a configuration that must match for runs to be reused: all of it
    but the list of optimizers, and the corpus by its content (sha256) only."""
    out = {k: v for k, v in config.items() if k not in ("optimizers", "corpus")}
    out["corpus_sha256"] = (config.get("corpus") or {}).get("sha256")
    return out


def config_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Every field where two configurations differ, as ``"name: OLD in the file,
    NEW requested"`` (nested fields dotted).

    Examples:
        >>> config_differences({"steps": 150, "model": {"n_layer": 4}},
        ...                    {"steps": 150, "model": {"n_layer": 6}})
        ['model.n_layer: 4 in the file, 6 requested']
    """
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new)):
            name = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(f"{name}: absent in the file, {new[k]!r} requested")
            elif k not in new:
                out.append(f"{name}: {old[k]!r} in the file, absent in this version")
            else:
                out.extend(config_differences(old[k], new[k], name))
        return out
    return [] if old == new else [f"{prefix}: {old!r} in the file, {new!r} requested"]


@dataclasses.dataclass
class Grid:
    """The runs of one configuration, keyed by ``(optimizer, lr, seed)``; a JSON file."""

    path: pathlib.Path
    result: dict[str, Any]

    def done(self, name: str, lr: float, seed: int) -> dict[str, Any] | None:
        return self.result["runs"].get(run_key(name, lr, seed))

    def add(self, name: str, lr: float, seed: int, run: dict[str, Any]) -> None:
        self.result["runs"][run_key(name, lr, seed)] = {
            "optimizer": name,
            "lr": lr,
            "seed": seed,
            "invocation": len(self.result["invocations"]) - 1,
            **run,
        }
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.path)  # a reader never sees half a file

    def points(self, name: str, seed: int = 0) -> dict[float, float]:
        return {
            r["lr"]: r["curve"]["final_val_loss"]
            for r in self.result["runs"].values()
            if r["optimizer"] == name and r["seed"] == seed
        }


def open_grid(
    path: pathlib.Path,
    fresh: dict[str, Any],
    *,
    resume: bool,
    rerun: list[str],
    report: bool = False,
) -> Grid:
    """The grid of ``fresh["config"]`` at ``path``: empty when the file is absent, its
    runs when ``resume`` (or ``report``) and the configurations match.

    ``fresh`` is ``{"meta": ..., "config": ...}`` of this invocation; its meta is
    appended to ``invocations`` (not for a report, which writes nothing). The
    optimizers of ``rerun`` have their runs moved to ``superseded``.

    Raises:
        SystemExit: the file exists and neither ``resume`` nor ``report`` is set; the
            file's configuration differs from ``fresh``'s (every differing field
            named); ``report`` without a file.
    """
    result: dict[str, Any] = {**fresh, "invocations": [], "runs": {}, "superseded": []}
    if not path.exists():
        if report:
            raise SystemExit(f"error: --report: no grid at {path}")
        result["invocations"].append(fresh["meta"])
        return Grid(path, result)
    old = json.loads(path.read_text())
    if not (resume or report):
        raise SystemExit(
            f"error: {path} already holds {len(old['runs'])} runs; pass --resume to add to "
            "it (runs already there are not repeated), or --tag for a new grid"
        )
    diff = config_differences(comparable(old["config"]), comparable(fresh["config"]))
    if diff:
        raise SystemExit(
            f"error: {path} holds a grid of another configuration ("
            + "; ".join(diff)
            + "); run with the file's settings to resume it, or use --tag for a new grid"
        )
    result["config"]["optimizers"] = list(
        dict.fromkeys(old["config"]["optimizers"] + fresh["config"]["optimizers"])
    )
    # A file written before invocations were listed: its meta made all its runs.
    result["invocations"] = old.get("invocations") or [old["meta"]]
    result["runs"] = old["runs"]
    result["superseded"] = old.get("superseded", [])
    if not report:
        result["invocations"].append(fresh["meta"])
    for spec in rerun:
        for key in [k for k, r in result["runs"].items() if r["optimizer"] == spec]:
            run = result["runs"].pop(key)
            run.setdefault("invocation", 0)
            result["superseded"].append(run)
    return Grid(path, result)
