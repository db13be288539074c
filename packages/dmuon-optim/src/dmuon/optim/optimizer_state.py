"""State of :class:`~dmuon.optim.DMuon`: created eagerly, restored after a state dict loads.

Every parameter gets its state at construction, on every rank, under the same keys
(DESIGN.md: "create every optimizer state eagerly so state dicts have the same keys
on every rank"). A parameter another rank steps holds *placeholders*: empty tensors
under the same keys. Matrix state is views into one stacked buffer per shape
(:func:`~dmuon.optim.build_buckets`); scalar state is one tensor per key. A dict is
checked before it loads by :mod:`dmuon.optim.loaded_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dmuon.optim.batch_layout import Bucket, build_buckets, state_shapes
from dmuon.optim.engine.base import Engine
from dmuon.optim.group_options import param_name
from dmuon.optim.layout import matrix_layout
from dmuon.optim.matrix_split import MatrixSplit, local_tensor
from dmuon.optim.rules import get_rule
from dmuon.optim.scalar import SCALAR_ALGORITHMS, scalar_state_dtype, scalar_state_shapes
from dmuon.optim.state_precision import state_dtype_of
from dmuon.optim.wrapper_names import WRAPPER_ATTRIBUTES, WRAPPER_NAMES

__all__ = [
    "FULL_STATE_FORMAT",
    "WRAPPER_ATTRIBUTES",
    "WRAPPER_NAMES",
    "StatePair",
    "build_state",
    "expected_state_shapes",
    "paired_states",
    "reload_matrix_state",
    "reload_scalar_state",
]

FULL_STATE_FORMAT = "dmuon.full_state_dict"
"""The ``"format"`` tag of a whole owner-mode optimizer state kept under one key, as
``dmuon.integrations.lightning.DMuonStrategy`` writes it into a checkpoint (its
``CHECKPOINT_FORMAT``): not a state dict of one optimizer, which
:func:`~dmuon.optim.loaded_state.check_state_dict_keys` says when one is loaded as such."""


def build_state(
    state: dict[Any, Any], group: dict[str, Any], index: int, engine: Engine
) -> dict[str | None, list[Bucket]]:
    """(Re)create group ``index``'s state in ``state``, keeping values of matching shape.

    The engine says which parameters this rank steps and in which pipeline group;
    the others get placeholder state (same keys, empty tensors), so every rank's
    state dict has the same keys. Returns the group's buckets per pipeline group
    (none for a scalar group).
    """
    names = group.get("param_names")
    algorithm = group["rule"]
    if algorithm in SCALAR_ALGORITHMS:
        for p in group["params"]:
            old = state.get(p, {})
            new: dict[str, torch.Tensor] = {}
            full = engine.steps(p)
            for key in scalar_state_shapes(algorithm, p):
                if key == "step":
                    t = torch.zeros((), dtype=torch.float32)
                elif full:  # fp32 for fp16/bf16 parameters (ε underflows in fp16)
                    dtype = scalar_state_dtype(p)
                    t = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                else:
                    t = _placeholder(p, scalar_state_dtype(p))
                value = old.get(key)
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(t.shape):
                    t.copy_(value)
                new[key] = t
            state[p] = new
        return {}
    rule = get_rule(algorithm)
    out: dict[str | None, list[Bucket]] = {}
    built: set[int] = set()
    # batched by name: the same stacking on every rank, whatever order each listed them in
    order = (
        sorted(range(len(names)), key=names.__getitem__)
        if names is not None and len(names) == len(group["params"])
        else None
    )
    stepped = _stepped_by_group(group["params"], engine, order)
    for pipeline_group in engine.step_groups():
        buckets, new_state = build_buckets(
            group,
            rule,
            lambda p: state.get(p, {}),
            lambda i: param_name(names, i, index, group["params"][i]),
            split_of=engine.split_of,
            on_shard=engine.on_shard,
            order=stepped.get(pipeline_group, ()),
        )
        out[pipeline_group] = buckets
        for p, st in new_state.items():
            state[p] = st
            built.add(id(p))
    for p in group["params"]:
        if id(p) not in built:  # stepped by another rank (or frozen): placeholders
            step = torch.zeros((), dtype=torch.float32)
            _copy_step(step, state.get(p, {}))
            holder = {"step": step}
            for spec in rule.state_specs():  # the owner's dtype: checkpoints broadcast it
                holder[spec.name] = _placeholder(p, state_dtype_of(group, p.dtype, spec))
            state[p] = holder
    return out


def expected_state_shapes(
    group: Mapping[str, Any],
    p: torch.Tensor,
    name: str,
    on_shard: Callable[[torch.Tensor], bool] | None = None,
    split_of: Callable[[torch.Tensor], MatrixSplit | None] | None = None,
) -> dict[str, tuple[int, ...]]:
    """The state keys of ``p`` on this rank and their shapes (see
    :func:`~dmuon.optim.loaded_state.check_loaded_state` for a split matrix's and a shard's).

    Examples:
        >>> import torch
        >>> w = torch.zeros(4, 6)
        >>> expected_state_shapes({"rule": "muon"}, w, "w")
        {'step': (), 'momentum_buffer': (4, 6)}
    """
    if group["rule"] in SCALAR_ALGORITHMS:
        return scalar_state_shapes(group["rule"], p)
    shard = on_shard is not None and on_shard(p)
    split = split_of(p) if split_of is not None and shard else None
    local: torch.Tensor = local_tensor(p) if shard else p
    if split is not None and split.local_shape is not None:
        local = torch.empty(split.local_shape, device="meta")
    if split is not None and not get_rule(group["rule"]).splits:
        local = p  # a rule that needs the whole matrix keeps whole state
    return state_shapes(get_rule(group["rule"]), matrix_layout(local, dict(group), name))


def reload_scalar_state(
    groups: list[dict[str, Any]], state: Mapping[Any, Any], state_dict: Mapping[str, Any]
) -> None:
    """Set the scalar rules' buffers of ``state`` again from ``state_dict``, in their own dtype.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its
    parameter's dtype, so the fp32 ``exp_avg``/``exp_avg_sq`` of an fp16/bf16
    parameter would come back through fp16 (small second moments flushed to 0).
    Called after it, this copies each saved buffer of matching shape once more, into a
    tensor of :func:`~dmuon.optim.scalar.scalar_state_dtype`: an fp32 dict loads
    exactly, and a dict saved with fp16/bf16 state (before DMuon kept it in fp32) is
    widened. Matrix state and entries it cannot match are left as they are.
    """
    for pair in paired_states(groups, state, state_dict):
        if pair.group.get("rule") not in SCALAR_ALGORITHMS:
            continue
        p, mine, theirs = pair.param, pair.mine, pair.theirs
        dtype = scalar_state_dtype(p)
        for key, value in list(mine.items()):
            other = theirs.get(key)
            if key == "step" or not isinstance(other, torch.Tensor):
                continue
            if not other.is_floating_point() or other.shape != value.shape:
                continue
            if value.dtype == dtype:
                value.copy_(other)
            else:
                mine[key] = other.to(device=p.device, dtype=dtype, copy=True)


def reload_matrix_state(
    groups: list[dict[str, Any]], state: Mapping[Any, Any], state_dict: Mapping[str, Any]
) -> None:
    """Copy the matrix rules' saved buffers of ``state_dict`` once more, into ``state``.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its
    parameter's dtype before :func:`build_state` copies it into the stacked buffers of
    the group's ``state_dtype``: the fp32 momentum of bf16 weights
    (``state_dtype="float32"``) would come back rounded to bf16. Called after it, this
    copies each saved buffer that torch cast (its dtype is not the parameter's) and
    whose shape matches into the live buffer, in place (the buffers stay views of their
    bucket). Placeholders and entries it cannot match are left as they are.
    """
    for pair in paired_states(groups, state, state_dict):
        if pair.group.get("rule") in SCALAR_ALGORITHMS:
            continue
        p, mine, theirs = pair.param, pair.mine, pair.theirs
        for key, value in mine.items():
            other = theirs.get(key)
            if key == "step" or not isinstance(other, torch.Tensor) or value.numel() == 0:
                continue
            if not other.is_floating_point() or other.dtype == p.dtype:
                continue  # torch did not cast it
            if other.shape == value.shape and type(other) is type(value):
                value.copy_(other)


class StatePair(NamedTuple):
    """One parameter's live state and the state a dict saved for it."""

    group: dict[str, Any]
    """The live param group."""
    param: torch.Tensor
    name: str
    """The parameter's name, as errors give it."""
    mine: dict[str, Any]
    """Its live state."""
    theirs: Mapping[str, Any]
    """The state the dict holds for it."""


def paired_states(
    groups: list[dict[str, Any]], state: Mapping[Any, Any], state_dict: Mapping[str, Any]
) -> Iterator[StatePair]:
    """Each parameter's live state with the state ``state_dict`` saved for it, matched by
    group and position as ``torch.optim.Optimizer.load_state_dict`` matches them.

    A group whose saved ``params`` is not a list of as many entries (torch refuses such
    a dict), and an entry that is not a state mapping on either side, are passed over.
    """
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping):
        return
    for gi, (live, saved) in enumerate(zip(groups, saved_groups, strict=False)):
        ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            continue
        for i, (p, pid) in enumerate(zip(live["params"], ids, strict=True)):
            mine, theirs = state.get(p), saved_state.get(pid)
            if isinstance(mine, dict) and isinstance(theirs, Mapping):
                name = param_name(live.get("param_names"), i, gi, p)
                yield StatePair(live, p, name, mine, theirs)


def _stepped_by_group(
    params: Sequence[torch.Tensor], engine: Engine, order: Sequence[int] | None
) -> dict[str | None, list[int]]:
    """The positions of the parameters this rank steps, per pipeline group, each list in
    ``order`` (the group's when ``None``).

    One pass over the group: asking every pipeline group (one per layer or layer pack in
    owner and sharded modes) to scan all the parameters made construction and
    ``load_state_dict`` take layers × parameters calls of ``engine.steps``/``group_of``.
    A parameter whose group is not among :meth:`~dmuon.optim.engine.base.Engine.step_groups`
    is built by none, as before: it gets placeholders.
    """
    out: dict[str | None, list[int]] = {}
    for i in order if order is not None else range(len(params)):
        p = params[i]
        if engine.steps(p):
            out.setdefault(engine.group_of(p), []).append(i)
    return out


def _placeholder(p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Empty state for a parameter another rank steps (same key, no memory)."""
    return torch.zeros(0, dtype=p.dtype if dtype is None else dtype, device=p.device)


def _copy_step(step: torch.Tensor, old: Mapping[str, Any]) -> None:
    value = old.get("step")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        step.copy_(value.reshape(()))
