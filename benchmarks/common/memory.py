"""Bytes a rank holds, counted from the tensors: weights, gradients, optimizer state, buffers.

On a CPU there is no ``torch.cuda.max_memory_allocated``; what a training setup
holds is counted from its tensors instead, each storage once (a parameter that is a
view into a flat bucket, a DTensor's local shard, one stacked state buffer shared by
a batch of matrices):

* ``weights``: the storages of the module's parameters (DTensors by their local shard);
* ``gradients``: the storages of their ``.grad``, as they stand when counted;
* ``optimizer_state``: the storages of the tensors in ``optimizer.state``;
* ``buffers``: every other storage reachable from the optimizer and the dedication
  object through their attributes, lists, tuples and dicts (DMuon's reduce and
  broadcast buckets, the engine's staging tensors); the frameworks' own buffers
  (DDP's buckets inside its C++ reducer, FSDP2's transient unsharded parameters) are
  not reachable from Python objects and not counted.

The figure is what the setup holds at the moment of counting, not a peak: FSDP2's
transient unsharded layer and the activations come and go within a step. The
process's peak resident set size is recorded beside it for that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["held_bytes", "state_bytes"]

KINDS = ("weights", "gradients", "optimizer_state", "buffers")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.is_meta:
            continue
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def state_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the tensors in ``opt.state`` on this rank, each storage counted once,
    split into the matrix rules' state and the scalar (AdamW, Lion) state."""
    kinds = {}
    for g in opt.param_groups:
        kind = "scalar" if g.get("rule", "adamw") in ("adamw", "lion") else "matrix"
        for p in g["params"]:
            kinds[id(p)] = kind
    seen: set[int] = set()
    out = {"matrix": 0, "scalar": 0}
    for p, st in opt.state.items():
        out[kinds.get(id(p), "scalar")] += _storage_bytes(st.values(), seen)
    return out


def _reachable(root: Any, depth: int = 8) -> list[torch.Tensor]:
    """Tensors reachable from ``root`` through attributes, lists, tuples, sets and dicts."""
    found: list[torch.Tensor] = []
    visited: set[int] = set()
    stack = [(root, 0)]
    while stack:
        obj, d = stack.pop()
        if id(obj) in visited or d > depth:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        if isinstance(obj, dict):
            children: Iterable[Any] = list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("dmuon", "torch.optim")):
            children = vars(obj).values()
        elif hasattr(obj, "__slots__") and type(obj).__module__.startswith("dmuon"):
            children = [getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s)]
        else:
            continue
        stack.extend((c, d + 1) for c in children)
    return found


def held_bytes(
    module: torch.nn.Module, opt: torch.optim.Optimizer, dedication: Any = None
) -> dict[str, int]:
    """``weights``, ``gradients``, ``optimizer_state``, ``buffers`` and ``total`` bytes
    this rank holds for one setup (see the module docstring for what each counts).

    ``opt`` may be a wrapper that holds the optimizer as ``opt.opt`` (the tensor-parallel
    benchmarks' ``GatherMuon``); the wrapped optimizer is counted.
    """
    if not isinstance(opt, torch.optim.Optimizer) and isinstance(
        getattr(opt, "opt", None), torch.optim.Optimizer
    ):
        opt = opt.opt
    seen: set[int] = set()
    params = list(module.parameters())
    out = {
        "weights": _storage_bytes(params, seen),
        "gradients": _storage_bytes([p.grad for p in params if p.grad is not None], seen),
        "optimizer_state": _storage_bytes(
            (v for st in opt.state.values() for v in st.values()), seen
        ),
    }
    roots = [opt] if dedication is None else [opt, dedication]
    out["buffers"] = sum(_storage_bytes(_reachable(r), seen) for r in roots)
    out["total"] = sum(out[k] for k in KINDS)
    return out
