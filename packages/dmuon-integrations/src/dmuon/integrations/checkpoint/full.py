"""One file for people who do not use DCP: the whole state gathered to rank 0.

:func:`full_state_dict` returns on rank 0 (``{}`` elsewhere) a plain dict of CPU
tensors that ``torch.save`` writes to one file::

    {"model": {fqn: tensor}, "optim": {"state": {fqn: {key: tensor}},
     "param_groups": [...]}, "dmuon": "<json>"}

every tensor whole: FSDP2 shards gathered, each owner's state sent to rank 0.
:func:`load_full_state_dict` takes that dict on every rank of a job of any size
(one process included) and gives each rank its part: the new owners their
matrices' state, FSDP2 shards their rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from dmuon.comm import wait_work
from dmuon.integrations.checkpoint.compat import (
    CheckpointMismatchError,
    check_compatible,
    load_into_optimizer,
    saved_groups,
)
from dmuon.integrations.checkpoint.dcp import describe_optimizer
from dmuon.integrations.checkpoint.deadline import checkpoint_deadline
from dmuon.integrations.checkpoint.holders import Holding, holdings, release, settle
from dmuon.integrations.checkpoint.owned_split import saved_entry, split_from_full
from dmuon.integrations.checkpoint.sharded_state import group_records, owner_steps, replica_entry
from dmuon.integrations.checkpoint.split_state import as_saved
from dmuon.integrations.checkpoint.whole import shard_of, whole_tensor
from dmuon.optim import DMuon
from dmuon.optim.engine.params import is_dtensor

__all__ = ["full_state_dict", "load_full_state_dict"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank0() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _gather_owned(h: Holding, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The owner's whole tensor on global rank 0 (``None`` elsewhere)."""
    group = h.group
    me = dist.get_rank(group)
    world: Any = dist.group.WORLD
    if 0 not in dist.get_process_group_ranks(group if group is not None else world):
        # owners over dp on a dp × tp mesh: this tp column's copy is the same as rank 0's
        return None
    first = dist.get_group_rank(group if group is not None else world, 0)  # global rank 0 here
    if h.owner == first:
        return value.detach().cpu().clone() if me == first else None
    if me == h.owner:
        work = dist.isend(value.detach().contiguous(), group_dst=first, group=group)
        wait_work(work, "send of an owner's state to rank 0", group)
        return None
    if me == first:
        out = torch.empty(shape, dtype=value.dtype, device=value.device)
        work = dist.irecv(out, group_src=h.owner, group=group)
        wait_work(work, f"receive of rank {h.owner}'s state", group)
        return out.cpu()
    return None


@torch.no_grad()
def full_state_dict(model: nn.Module, optimizer: DMuon) -> dict[str, Any]:
    """The whole model and optimizer state as one plain dict on rank 0 (collective).

    Call it on every rank; rank 0 gets the dict (CPU tensors, ``torch.save``-able),
    the others ``{}``. Optimizer state is keyed by fully-qualified parameter name.

    Args:
        model: the model the optimizer was built on (FSDP2-sharded or plain).
        optimizer: the :class:`~dmuon.optim.DMuon`.

    Returns:
        ``{"model": ..., "optim": {"state": ..., "param_groups": ...}, "dmuon": ...}``
        on rank 0, ``{}`` on the other ranks.

    Raises:
        TypeError: ``optimizer`` is not a DMuon.
        ValueError: a parameter of the optimizer is not in ``model``, or mode ``sign``.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> from dmuon.integrations.checkpoint import full_state_dict
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> sd = full_state_dict(model, DMuon(param_groups(model)))
        >>> sorted(sd)
        ['dmuon', 'model', 'optim']
        >>> momentum = sd["optim"].get("state").get("0.weight").get("momentum_buffer")
        >>> tuple(momentum.shape)
        (8, 4)
    """
    held = holdings(model, optimizer)
    settle(optimizer)
    try:
        with checkpoint_deadline(optimizer, "DMuon checkpoint save (full)"):
            # Each rank's own part (no collective), gathered whole by DMuon's all-gathers
            # under the deadline (whole.py), not by DSD's full_state_dict, whose gathers
            # wait for the process group's timeout. On a CPU a plain (or replicated)
            # parameter is the live tensor itself: copy it here, before release() frees
            # the weights this rank does not own (reshard_after_forward), and so that the
            # dict does not follow the training that goes on.
            model_sd: dict[str, Any] = {}
            for fqn, value in get_model_state_dict(model).items():
                whole = whole_tensor(value, fqn) if isinstance(value, torch.Tensor) else value
                if _rank0():
                    model_sd[fqn] = (
                        whole.detach().cpu().clone() if isinstance(whole, torch.Tensor) else whole
                    )
            steps = owner_steps(optimizer, [h for h in held if h.owner is not None])
            state: dict[str, dict[str, torch.Tensor]] = {}
            from dmuon.integrations.checkpoint.compat import expected_state_shapes

            for h in held:
                current = optimizer.state[h.param]
                shapes = expected_state_shapes(h, optimizer.param_groups[h.group_index])
                entry: dict[str, torch.Tensor] = {}
                if h.split or h.experts:  # laid out like the parameter: assemble it
                    # (the owner's tp row, owned_split.py; experts' replicas, sharded_state.py)
                    made = replica_entry if h.experts else saved_entry
                    for key, saved in made(optimizer, h, steps[h.fqn]).items():
                        whole = whole_tensor(saved, f"{h.fqn}.{key}")
                        entry[key] = whole.cpu().clone()
                    state[h.fqn] = entry if _rank0() else {}
                    continue
                for key, value in current.items():
                    full: torch.Tensor | None
                    # a split matrix's shards as one DTensor (split_state.py)
                    stored: Any = as_saved(value, h.param) if h.owner is None else value
                    if key == "step" and h.owner is not None:
                        full = steps[h.fqn].cpu().clone()
                    elif h.owner is not None:
                        full = _gather_owned(h, value, shapes[key])
                    elif is_dtensor(stored):
                        # a Replicate DTensor's whole tensor on a CPU is the live state
                        # itself: copy, so the dict does not follow the training
                        full = whole_tensor(stored, f"{h.fqn}.{key}").cpu().clone()
                    else:
                        full = value.detach().cpu().clone()
                    if full is not None:
                        entry[key] = full
                state[h.fqn] = entry
    finally:
        release(optimizer)
    if not _rank0():
        return {}
    return {
        "model": model_sd,
        "optim": {"state": state, "param_groups": group_records(optimizer, held)},
        "dmuon": describe_optimizer(optimizer),
    }


def _flat_shapes(sd: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    out: dict[str, tuple[int, ...] | None] = {}
    for fqn, t in (sd.get("model") or {}).items():
        out[f"model.{fqn}"] = tuple(t.shape) if isinstance(t, torch.Tensor) else None
    for fqn, entry in ((sd.get("optim") or {}).get("state") or {}).items():
        for key, t in entry.items():
            out[f"optim.state.{fqn}.{key}"] = (
                tuple(t.shape) if isinstance(t, torch.Tensor) else None
            )
    return out


def _check_dtypes(
    held: list[Holding], optimizer: DMuon, local: Mapping[str, Any], sd: Mapping[str, Any]
) -> None:
    """Refuse a tensor that is not floating where the model's or the optimizer's is: the
    copy would cast it (an int64 momentum of magnitude 1e-2 became zeros; a complex one
    lost its imaginary part), before anything changes."""
    problems = []
    for fqn, full in (sd.get("model") or {}).items():
        mine = local.get(fqn)
        if mine is not None and _not_floating_like(full, mine):
            problems.append(f"'model.{fqn}' is {full.dtype} in the checkpoint, {mine.dtype} here")
    saved = (sd.get("optim") or {}).get("state") or {}
    for h in held:
        for key, value in optimizer.state[h.param].items():
            full = (saved.get(h.fqn) or {}).get(key)
            if full is not None and key != "step" and _not_floating_like(full, value):
                problems.append(
                    f"'optim.state.{h.fqn}.{key}' is {full.dtype} in the checkpoint, "
                    f"{value.dtype} here"
                )
    if problems:
        raise CheckpointMismatchError(
            [*problems, "a floating-point tensor was expected (the load would cast it)"]
        )


def _not_floating_like(saved: Any, mine: Any) -> bool:
    return (
        isinstance(saved, torch.Tensor)
        and isinstance(mine, torch.Tensor)
        and mine.is_floating_point()
        and not saved.is_floating_point()
    )


@torch.no_grad()
def load_full_state_dict(model: nn.Module, optimizer: DMuon, state_dict: Mapping[str, Any]) -> None:
    """Load a :func:`full_state_dict` into ``model`` and ``optimizer``, at any world size.

    Call it on every rank with the same dict (e.g. ``torch.load(path, mmap=True)``
    on each); each rank keeps its part. Everything is checked before anything
    changes.

    Args:
        model: the model, built as for the saved run (``dedicate`` / ``fully_shard``
            applied as for a fresh start).
        optimizer: a :class:`~dmuon.optim.DMuon` with the same groups and rules.
        state_dict: what :func:`full_state_dict` returned on rank 0.

    Raises:
        CheckpointMismatchError: a missing key, a shape that differs, a group with
            another rule, other parameters or hyperparameters that do not check
            (nothing is changed).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> from dmuon.integrations.checkpoint import full_state_dict, load_full_state_dict
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = DMuon(param_groups(model))
        >>> sd = full_state_dict(model, opt)
        >>> load_full_state_dict(model, opt, sd)
    """
    if (
        not isinstance(state_dict, Mapping)
        or "model" not in state_dict
        or "optim" not in state_dict
    ):
        keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise CheckpointMismatchError(
            [f"state_dict must have 'model' and 'optim' (what full_state_dict returns), got {keys}"]
        )
    held = holdings(model, optimizer)
    groups = saved_groups(state_dict["optim"])
    settle(optimizer)
    try:
        local: dict[str, Any] = get_model_state_dict(model)
        check_compatible(
            held,
            optimizer,
            {k: tuple(v.shape) for k, v in local.items()},
            _flat_shapes(state_dict),
            groups,
        )
        _check_dtypes(held, optimizer, local, state_dict)
        # every rank holds the whole dict: each cuts its own shards (no collective), where
        # DSD's full_state_dict would scatter rank 0's with no deadline. The model's own
        # keys only, as DCP's load reads them: a saved entry the model no longer has (a
        # buffer dropped since) is left, not refused after the weights were written
        set_model_state_dict(
            model,
            {
                fqn: shard_of(full.to(local[fqn].device), local[fqn])
                if is_dtensor(local[fqn])
                else full
                for fqn, full in state_dict["model"].items()
                if fqn in local
            },
        )
        saved = state_dict["optim"]["state"]
        values: dict[str, dict[str, torch.Tensor]] = {}
        for h in held:
            current = optimizer.state[h.param]
            entry: dict[str, torch.Tensor] = {}
            for key, value in current.items():
                full = saved[h.fqn][key]
                form: Any = as_saved(value, h.param) if h.owner is None else value
                if key == "step":
                    entry[key] = full.clone()
                elif h.split:  # the owner's tp row: each its shard (owned_split.py)
                    mine = split_from_full(optimizer, h, key, full.to(value.device))
                    if mine is not None:
                        entry[key] = mine
                elif h.experts:  # its owner's local experts, a slice of the whole stack
                    if h.held_here():
                        form = as_saved(torch.empty_like(value), h.param)
                        entry[key] = shard_of(full.to(value.device), form)
                elif h.owner is not None:
                    if h.held_here():
                        entry[key] = full.to(value.device).clone()
                elif is_dtensor(form):
                    entry[key] = shard_of(full.to(value.device), form)  # a slice, no traffic
                else:
                    entry[key] = full.to(value.device).clone()
            values[h.fqn] = entry
        load_into_optimizer(optimizer, held, values, groups)
    finally:
        release(optimizer)
