"""Every rank must hold the same model before the first collective, or the error names
the parameter.

A rank whose model differs (a shape, an extra or missing parameter, another
dtype) would issue collectives the others do not, and the job would hang until a
timeout. The engine compares the owner plans first
(:func:`dmuon.comm.check_plan_consistency`: one all-gather of a fixed-size
fingerprint, so it cannot hang on the mismatch itself); only when they differ do
the ranks exchange their parameter lists to say *which* parameter differs.

Where each rank planned for itself (``dedicate()``, DMuon's own modes),
:func:`dmuon.comm.plan_adoption.adopt_first_plan` has already given every rank the first
rank's plan if only the owners differed (an ILP solve stopped by its wall-clock limit at
different points on different ranks), so what is left to find here is a different model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from dmuon.comm import (
    MatrixItem,
    OwnerPlan,
    PlanMismatchError,
    all_gather_objects,
    check_plan_consistency,
    wait_work,
)
from dmuon.comm.flags import flag_device
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["ModelMismatchError", "check_model_consistency", "plan_with_replicated"]


class ModelMismatchError(PlanMismatchError):
    """The ranks hold different models, or plan one model's owners differently (raised on
    every rank, before any other collective).

    Attributes:
        digests: global rank → that rank's plan digest prefix.
        differences: one line per difference, naming the parameter and the ranks (empty
            when the parameters agree and only the owners differ).

    Examples:
        >>> err = ModelMismatchError("models differ", {0: "ab", 1: "cd"}, ["rank 1: extra 'w'"])
        >>> err.differences
        ["rank 1: extra 'w'"]
    """

    def __init__(self, message: str, digests: dict[int, str], differences: list[str]):
        super().__init__(message, digests)
        self.differences = differences


_Entry = tuple[str, tuple[int, ...], str, str | None]


def _parameter_list(plan: OwnerPlan) -> list[_Entry]:
    return [
        (i.name, tuple(i.shape), str(i.dtype).removeprefix("torch."), i.layer) for i in plan.items
    ]


def _differences(lists: list[list[_Entry]], ranks: list[int]) -> list[str]:
    """Lines naming each parameter that is not the same on every rank."""
    # The reference is the most common list (ties: the lowest rank's).
    keys = [repr(x) for x in lists]
    ref_k = max(range(len(keys)), key=lambda k: (keys.count(keys[k]), -k))
    ref = {name: (shape, dtype) for name, shape, dtype, _ in lists[ref_k]}
    ref_layer = {name: layer for name, _, _, layer in lists[ref_k]}
    lines: list[str] = []
    for k, items in enumerate(lists):
        if keys[k] == keys[ref_k]:
            continue
        mine = {name: (shape, dtype) for name, shape, dtype, _ in items}
        layer = {name: key for name, _, _, key in items}
        who = f"rank {ranks[k]}"
        base = f"rank {ranks[ref_k]}"
        for name in mine.keys() - ref.keys():
            lines.append(f"{who} has parameter {name!r} {mine[name][0]}, which {base} lacks")
        for name in ref.keys() - mine.keys():
            lines.append(f"{who} lacks parameter {name!r} {ref[name][0]}, which {base} has")
        for name in sorted(mine.keys() & ref.keys()):
            if mine[name] != ref[name]:
                lines.append(
                    f"{who} has parameter {name!r} with shape {mine[name][0]} {mine[name][1]}, "
                    f"{base} has {ref[name][0]} {ref[name][1]}"
                )
            elif layer[name] != ref_layer[name]:
                # the same parameters grouped into other units: other buffers would travel
                lines.append(
                    f"{who} has parameter {name!r} in layer {layer[name]!r}, {base} in "
                    f"{ref_layer[name]!r}"
                )
        if len(lines) > 20:
            lines.append("…")
            break
    return sorted(lines)


def _check_group(plan: OwnerPlan, group: dist.ProcessGroup | None) -> ModelMismatchError | None:
    try:
        check_plan_consistency(plan, group)
    except PlanMismatchError as err:
        # Every rank of the group raised the same error, so every rank is here: the
        # object all-gather below cannot hang on a rank that went on.
        n = dist.get_world_size(group)
        gathered = all_gather_objects(_parameter_list(plan), group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        lines = _differences([list(g) for g in gathered], ranks)
        if not lines:
            # The same parameters, grouped alike: the plans differ in their owners (or the
            # sizes they were made for), not the models, and rebuilding would not help.
            text = (
                "the ranks hold the same parameters but different owner plans for them:\n"
                f"{err}\n  dedicate() and DMuon(distributed=...) give every rank the first "
                "rank's plan themselves; for a plan made by hand, pass every rank the same "
                "one (dmuon.comm.plan_adoption.adopt_first_plan takes the first rank's)"
            )
            return ModelMismatchError(text, err.digests, lines)
        text = "the ranks hold different models, so their collectives would not match:\n"
        text += "\n".join(f"  {line}" for line in lines)
        text += "\n  build the same model on every rank (same config, same frozen parameters)"
        if any(" in layer " in line for line in lines):
            text += (
                ", grouped into the same layers (layer_of) and packs of layers (layer_pack_mb; "
                "a pack is named 'first..last')"
            )
        return ModelMismatchError(text, err.digests, lines)
    return None


def check_model_consistency(
    plan: OwnerPlan,
    group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
) -> str:
    """Check that every rank planned the same parameters; raise on every rank if not.

    Args:
        plan: this rank's plan (HSDP: over the ``R·S`` slots).
        group: the ranks that must agree (HSDP: the shard group); default the world.
        replicate_group: HSDP only, the replicate group: a mismatch found in one shard
            group is passed on across the replicate groups, so every rank raises.

    Returns:
        The plan digest.

    Raises:
        ModelMismatchError: on every rank, naming the parameters that differ.

    Examples:
        >>> from dmuon.comm import MatrixItem, plan_owners
        >>> plan = plan_owners([MatrixItem("w", (4, 4))], 1)
        >>> check_model_consistency(plan) == plan.digest()
        True
    """
    if replicate_group is None:
        err = _check_group(plan, group)
        if err is not None:
            raise err
        return plan.digest()
    S = dist.get_world_size(group)
    R = dist.get_world_size(replicate_group)
    err = _check_group(_folded(plan, S, lambda o: o % S), group)
    # Pass a shard group's verdict on across the replicate groups: each holds one
    # rank of every shard group, so if any shard group disagreed every rank learns
    # it (and its message) here, and no rank goes on alone.
    device = flag_device(replicate_group)
    flags = torch.empty(R, dtype=torch.int64, device=device)
    verdict = torch.tensor([int(err is not None)], dtype=torch.int64, device=device)
    work = all_gather_single(flags, verdict, group=replicate_group, async_op=True)
    wait_work(work, "all-gather of the plan check's verdicts", replicate_group)
    if bool(flags.any()):
        texts = all_gather_objects(None if err is None else str(err), group=replicate_group)
        if err is not None:
            raise err
        first = next(t for t in texts if t is not None)
        raise ModelMismatchError(str(first), {}, [])
    err = _check_group(_folded(plan, R, lambda o: o // S), replicate_group)
    if err is not None:
        raise err
    return plan.digest()


def _folded(plan: OwnerPlan, size: int, fold: Callable[[int], int]) -> OwnerPlan:
    """The plan's items over one dimension of an HSDP mesh (owners folded onto it)."""
    return OwnerPlan(plan.items, tuple(fold(o) for o in plan.owners), (), (0.0,) * size, size)


def plan_with_replicated(
    plan: OwnerPlan,
    replicated: Sequence[tuple[str, str, torch.Tensor]],
    unit_of: Mapping[str, str] | None = None,
) -> OwnerPlan:
    """``plan`` plus the all-reduced ``(name, layer, parameter)`` triples (owner 0).

    For :func:`check_model_consistency` only: the model check then covers the
    parameters a DDP replacement all-reduces as well as the dedicated ones, and with
    ``unit_of`` (name → the key of its unit of reduction and publication: its layer,
    or its pack of layers) each parameter's unit in place of its layer, so that ranks
    that pack their layers differently are told before their buffers differ.
    """
    if unit_of is not None:
        plan = OwnerPlan(
            tuple(replace(i, layer=unit_of.get(i.name, i.layer)) for i in plan.items),
            plan.owners,
            (),
            plan.loads,
            plan.world_size,
            plan.replicate_size,
        )
        replicated = [(n, unit_of.get(n, key), p) for n, key, p in replicated]
    if not replicated:
        return plan
    extra = tuple(
        MatrixItem(f"[all-reduced] {n}", (1, max(1, p.numel())), p.dtype, key)
        for n, key, p in replicated
    )
    items = plan.items + extra
    owners = plan.owners + (0,) * len(extra)
    return OwnerPlan(items, owners, (), plan.loads, plan.world_size, plan.replicate_size)
