"""What ``dmuon-plan`` prints: a table for people, JSON (with its schema) for machines,
and a PNG of the overhead against the number of GPUs."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dmuon.optim.planner.step_model import Prediction, TrainingShape, predict

__all__ = ["SCHEMA", "format_report", "plot_overhead", "to_json", "validate"]

_NUM = {"type": "number"}
_MODE = {
    "type": "object",
    "required": [
        "mode",
        "fwd_bwd_ms",
        "ns_ms",
        "adamw_ms",
        "comm_ms",
        "exposed_comm_ms",
        "optimizer_ms",
        "step_ms",
        "ns_flops_per_rank_max",
        "ns_flops_per_rank_mean",
        "bytes_per_rank_dmuon",
        "bytes_per_rank_framework",
        "tp_ms",
        "bytes_per_rank_tp",
        "framework_copies_ms",
        "memory_bytes",
        "overhead_vs_adamw",
        "speedup_vs_vanilla",
        "transfers",
    ],
    "properties": {
        "mode": {"type": "string"},
        "fwd_bwd_ms": _NUM,
        "ns_ms": _NUM,
        "adamw_ms": _NUM,
        "optimizer_ms": _NUM,
        "step_ms": _NUM,
        "ns_flops_per_rank_max": {"type": "integer"},
        "ns_flops_per_rank_mean": _NUM,
        "bytes_per_rank_dmuon": _NUM,
        "bytes_per_rank_framework": _NUM,
        "tp_ms": _NUM,
        "bytes_per_rank_tp": _NUM,
        "framework_copies_ms": _NUM,
        "overhead_vs_adamw": _NUM,
        "speedup_vs_vanilla": _NUM,
        "comm_ms": {
            "type": "object",
            "required": ["forward", "backward", "step"],
            "additionalProperties": _NUM,
        },
        "exposed_comm_ms": {
            "type": "object",
            "required": ["forward", "backward", "step"],
            "additionalProperties": _NUM,
        },
        "memory_bytes": {
            "type": "object",
            "required": ["weights", "gradients", "optimizer_state", "buffers", "total"],
            "additionalProperties": _NUM,
        },
        "transfers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "op",
                    "collective",
                    "phase",
                    "bytes_per_rank_max",
                    "collectives",
                    "recorded_by_commstats",
                ],
                "properties": {
                    "op": {"type": "string"},
                    "collective": {"type": "string"},
                    "phase": {"enum": ["forward", "backward", "step"]},
                    "bytes_per_rank_max": _NUM,
                    "collectives": {"type": "integer"},
                    "recorded_by_commstats": {"type": "boolean"},
                },
            },
        },
    },
}
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dmuon-plan --json",
    "type": "object",
    "required": ["version", "model", "cluster", "shape", "plan", "modes", "assumptions"],
    "properties": {
        "version": {"const": 1},
        "model": {"type": "object",
                  "required": ["name", "total_params", "matrix_params", "scalar_params",
                               "active_params", "matrices", "source"],
                  "properties": {"name": {"type": "string"}, "total_params": {"type": "integer"},
                                 "matrix_params": {"type": "integer"},
                                 "scalar_params": {"type": "integer"},
                                 "active_params": {"type": "integer"},
                                 "matrices": {"type": "integer"}, "source": {"type": "string"}}},
        "cluster": {"type": "object",
                    "required": ["device", "gpus", "gpus_per_node", "intra", "inter", "dp",
                                 "tp", "ep"],
                    "properties": {"device": {"type": "object"}, "gpus": {"type": "integer"},
                                   "dp": {"type": "integer"}, "tp": {"type": "integer"},
                                   "ep": {"type": "integer"},
                                   "gpus_per_node": {"type": "integer"},
                                   "intra": {"type": "object"}, "inter": {"type": "object"}}},
        "shape": {"type": "object", "required": ["global_tokens", "seq_len", "mfu", "method"]},
        "plan": {"type": "object",
                 "required": ["world_size", "imbalance", "max_load_ms", "mean_load_ms",
                              "items_per_rank_max"],
                 "properties": {"world_size": {"type": "integer"}, "imbalance": _NUM,
                                "max_load_ms": _NUM, "mean_load_ms": _NUM,
                                "items_per_rank_max": {"type": "integer"},
                                "owner_imbalance": _NUM, "owner_max_load_ms": _NUM,
                                "owner_mean_load_ms": _NUM}},
        "modes": {"type": "object", "required": ["adamw", "vanilla"],
                  "additionalProperties": _MODE},
        "assumptions": {"type": "array", "items": {
            "type": "object", "required": ["what", "value"],
            "properties": {"what": {"type": "string"}, "value": {"type": "string"}}}},
    },
}  # fmt: skip
"""JSON Schema (2020-12 subset) of ``dmuon-plan --json``; times in ms, sizes in bytes.

Per mode, ``tp_ms`` and ``bytes_per_rank_tp`` are the tensor-parallel collectives of
the busiest rank's tp row (0 with ``--tp 1``); ``framework_copies_ms`` FSDP2's copies
around its collectives (compute-side work, in ``step_ms``); the ``plan`` is over the
``dp`` ranks."""


def to_json(p: Prediction) -> dict[str, Any]:
    """The prediction as the JSON ``dmuon-plan --json`` prints (see :data:`SCHEMA`)."""
    c, s, plan = p.cluster, p.shape, p.plan
    return {
        "version": 1,
        "model": {
            "name": p.spec.name,
            "total_params": p.spec.total_params,
            "matrix_params": p.spec.matrix_params,
            "scalar_params": p.spec.scalar_params,
            "active_params": p.spec.active_params,
            "matrices": len(p.spec.matrices),
            "source": p.spec.source,
        },
        "cluster": {
            "device": c.device.to_json(),
            "gpus": c.gpus,
            "gpus_per_node": c.gpus_per_node,
            "intra": vars(c.intra),
            "inter": vars(c.inter),
            "dp": c.gpus // s.tp,
            "tp": s.tp,
            "ep": s.ep,
        },
        "shape": {
            "global_tokens": s.global_tokens,
            "seq_len": s.seq_len,
            "mfu": s.mfu,
            "fwd_bwd_ms": None if s.fwd_bwd_s is None else s.fwd_bwd_s * 1e3,
            "method": s.method,
            "ns_steps": s.ns_steps,
            "restarts": list(s.restarts),
            "tp_path": s.tp_path,
            "rule": s.rule,
            "state_dtype": s.state_dtype,
            "ns_compute_dtype": s.ns_compute_dtype,
        },
        "plan": {
            "world_size": plan.world_size,
            "imbalance": plan.imbalance(),
            "max_load_ms": plan.max_load * 1e3,
            "mean_load_ms": plan.total_load / plan.world_size * 1e3,
            "items_per_rank_max": max(len(plan.items_of(r)) for r in range(plan.world_size)),
            # owner mode's work per rank as the engine runs it (the text's owner plan line)
            "owner_imbalance": p.owner_imbalance,
            "owner_max_load_ms": max(p.owner_loads, default=0.0) * 1e3,
            "owner_mean_load_ms": sum(p.owner_loads) / max(1, len(p.owner_loads)) * 1e3,
        },
        "modes": {k: m.as_dict() for k, m in p.modes.items()},
        "assumptions": [{"what": w, "value": v} for w, v in p.assumptions],
    }


_TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def validate(obj: Any, schema: dict[str, Any] = SCHEMA, where: str = "$") -> None:
    """Check ``obj`` against the subset of JSON Schema :data:`SCHEMA` uses.

    Supports ``type``, ``const``, ``enum``, ``required``, ``properties``,
    ``additionalProperties`` (a schema) and ``items``.

    Raises:
        ValueError: naming the path of the first value that does not fit.

    Examples:
        >>> validate({"a": 1}, {"type": "object", "required": ["b"]})
        Traceback (most recent call last):
        ...
        ValueError: $: missing required field 'b'
    """
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(obj, _TYPES[kind]) and not (
            kind in ("integer", "number") and isinstance(obj, bool)
        )
        if not ok:
            raise ValueError(f"{where}: expected {kind}, got {type(obj).__name__} {obj!r:.60}")
    if "const" in schema and obj != schema["const"]:
        raise ValueError(f"{where}: expected {schema['const']!r}, got {obj!r}")
    if "enum" in schema and obj not in schema["enum"]:
        raise ValueError(f"{where}: expected one of {schema['enum']}, got {obj!r}")
    if isinstance(obj, dict):
        for key in schema.get("required", []):
            if key not in obj:
                raise ValueError(f"{where}: missing required field {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if key in props:
                validate(value, props[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                validate(value, extra, f"{where}.{key}")
    if isinstance(obj, list) and "items" in schema:
        for i, value in enumerate(obj):
            validate(value, schema["items"], f"{where}[{i}]")


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _rows(p: Prediction) -> tuple[list[str], list[list[str]]]:
    head = [
        "mode", "step ms", "vs AdamW", "vs vanilla", "fwd+bwd ms", "NS ms", "opt ms",
        "exposed comm ms", "DMuon MB/rank", "framework MB/rank", "NS GFLOP/rank",
        "memory GiB (w/g/s/buf = total)",
    ]  # fmt: skip
    tp = p.shape.tp > 1
    if tp:
        head[7:7] = ["TP ms"]
        head[11:11] = ["TP MB/rank"]
    # FSDP2's copy-in/copy-out around its collectives (compute-side work in step ms)
    copies = any(m.copies_s > 0 for m in p.modes.values())
    if copies:
        head[5:5] = ["copies ms"]
    rows = []
    for m in p.modes.values():
        mem = m.memory
        row = [
            m.mode,
            f"{m.step_s * 1e3:.1f}",
            f"{m.overhead_vs_adamw:+.1%}",
            f"{m.speedup_vs_vanilla:.2f}×",
            f"{m.fwd_bwd_s * 1e3:.1f}",
            f"{m.ns_s * 1e3:.2f}",
            f"{m.optimizer_s * 1e3:.2f}",
            f"{sum(m.exposed_s.values()) * 1e3:.2f}",
            f"{m.bytes_dmuon / 1e6:.1f}",
            f"{m.bytes_framework / 1e6:.1f}",
            f"{m.ns_flops_max / 1e9:.1f}",
            f"{_gib(mem['weights'])}/{_gib(mem['gradients'])}/"
            f"{_gib(mem['optimizer_state'])}/{_gib(mem['buffers'])} = {_gib(mem['total'])}",
        ]
        if tp:
            row[7:7] = [f"{m.tp_s * 1e3:.2f}"]
            row[11:11] = [f"{m.bytes_tp / 1e6:.1f}"]
        if copies:
            row[5:5] = [f"{m.copies_s * 1e3:.2f}"]
        rows.append(row)
    return head, rows


def _plain(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, rows)])


def _summary(p: Prediction) -> list[str]:
    plan, c = p.plan, p.cluster
    fits = c.device.memory_bytes
    too_big = [m.mode for m in p.modes.values() if m.memory["total"] > fits]
    loads = p.owner_loads or (0.0,)
    return [
        f"model {p.spec.name}: {p.spec.total_params / 1e9:.3f} B parameters "
        f"({p.spec.matrix_params / 1e9:.3f} B in {len(p.spec.matrices)} Muon matrices)",
        f"cluster: {c.gpus} × {c.device.name}, {c.gpus_per_node} per node, "
        f"{c.intra.name} inside a node, {c.inter.name} between nodes",
        f"owner plan: {plan.world_size} {'dp ' if p.shape.tp > 1 else ''}ranks"
        + (f" (× tp {p.shape.tp})" if p.shape.tp > 1 else "")
        + (f", experts on ep {p.shape.ep}" if p.shape.ep > 1 else "")
        + f", imbalance {p.owner_imbalance:.1%} (max {max(loads) * 1e3:.2f} ms, mean "
        f"{sum(loads) / len(loads) * 1e3:.2f} ms of owner mode's Newton–Schulz"
        + (" and tp collectives" if p.shape.tp > 1 else "")
        + " per rank in the engine's calls; as planned, batched across layers"
        + (" on whole shapes" if p.shape.tp > 1 else "")
        + f": {plan.imbalance():.1%}, max {plan.max_load * 1e3:.2f} ms)",
        "memory excludes activations; "
        + (
            f"over the device's {fits / 2**30:.0f} GiB already: {', '.join(too_big)}"
            if too_big
            else f"every mode fits in {fits / 2**30:.0f} GiB before activations"
        ),
    ]


def format_report(p: Prediction, *, pretty: bool | None = None) -> str:
    """The human report: summary lines, the per-mode table and the assumptions.

    ``pretty=None`` uses rich when it is installed and stdout is a terminal.
    """
    head, rows = _rows(p)
    if pretty is None:
        pretty = sys.stdout.isatty()
    if pretty:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pretty = False
    if pretty:
        console = Console(record=True, width=200)
        for line in _summary(p):
            console.print(line)
        table = Table(*head)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        assume = Table("assumption", "value (source)")
        for w, v in p.assumptions:
            assume.add_row(w, v)
        console.print(assume)
        return console.export_text()
    parts = [*_summary(p), "", _plain(head, rows), "", "assumptions:"]
    parts += [f"  {w}: {v}" for w, v in p.assumptions]
    return "\n".join(parts)


def overhead_curve(
    p: Prediction, gpus: Sequence[int] = (8, 16, 32, 64, 128, 256, 512, 1024)
) -> dict[str, list[float]]:
    """Overhead vs AdamW of each mode of ``p`` at each GPU count (same global batch);
    NaN where the GPUs cannot take the ``tp``/``ep`` layout."""
    curves: dict[str, list[float]] = {m: [] for m in p.modes}
    shape: TrainingShape = p.shape
    for n in gpus:
        if n % shape.tp or (n // shape.tp) % shape.ep:  # the mesh does not fit n GPUs
            for m in curves:
                curves[m].append(float("nan"))
            continue
        q = predict(p.spec, p.cluster.with_gpus(n), replace(shape), modes=tuple(p.modes))
        for m in curves:
            curves[m].append(q.modes[m].overhead_vs_adamw)
    return curves


def plot_overhead(
    p: Prediction, path: str, gpus: Sequence[int] = (8, 16, 32, 64, 128, 256, 512, 1024)
) -> dict[str, list[float]]:
    """Write a PNG of the overhead vs AdamW against the number of GPUs, one line per mode.

    Needs matplotlib (``pip install 'dmuon-optim[plan]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'dmuon-optim[plan]'") from err
    curves = overhead_curve(p, gpus)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, ys in curves.items():
        if mode == "adamw":
            continue
        ax.plot(list(gpus), [100 * y for y in ys], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted step overhead vs FSDP2 + AdamW (%)")
    ax.set_title(f"{p.spec.name} on {p.cluster.device.name}, {p.shape.global_tokens:,} tokens/step")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return curves
