"""DMuon's optimizer state in the form ``torch.distributed.checkpoint`` saves and reshards.

:func:`optimizer_state_dict` returns, on every rank, the structure of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``::

    {"state": {fqn: {"step": tensor, "momentum_buffer": tensor, ...}},
     "param_groups": [{"lr": ..., "rule": "muon", ..., "params": [fqn, ...]}]}

with the same keys on every rank (DCP plans the save collectively). A tensor an
owner holds whole is scattered from the owner into a ``Shard(0)`` DTensor over the
owners' group (:func:`scattered`: ``distribute_tensor(..., src_data_rank=owner)``'s
result, bitwise, from a scatter waited under the checkpoint's deadline): each rank
contributes its rows, so the tensor is written once, in pieces, with no rank
holding a second full copy, and DCP records it as one global tensor that any world
size can read back. Its ``step`` counter, advanced only by the owner, is made
the owner's on every rank by one small all-reduce. FSDP2's sharded state is
already a DTensor; state every rank holds alike (all-reduced scalar parameters)
stays a plain tensor, which DCP writes once.

:func:`state_targets` gives the tensors a rank loads into: a parameter's owner
under the *new* plan reads the whole tensor directly (DCP reads the rows it needs
from every saved piece), the other ranks read nothing for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm import shard_range, wait_work
from dmuon.comm.chunk_gather import padded_chunks
from dmuon.comm.flags import flag_device
from dmuon.integrations.checkpoint.compat import expected_state_shapes
from dmuon.integrations.checkpoint.deadline import checkpoint_deadline
from dmuon.integrations.checkpoint.holders import Holding, holdings
from dmuon.integrations.checkpoint.owned_split import owner_shapes, saved_entry, split_target
from dmuon.integrations.checkpoint.split_state import as_saved
from dmuon.optim import DMuon, get_rule
from dmuon.optim.batch_layout import state_shapes
from dmuon.optim.layout import matrix_layout

__all__ = [
    "group_records",
    "local_expert_shapes",
    "optimizer_state_dict",
    "replica_entry",
    "scattered",
    "state_targets",
    "state_to_save",
]


def _mesh(group: Any, device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    world: Any = dist.group.WORLD
    return DeviceMesh.from_group(group if group is not None else world, device.type)


def group_records(optimizer: DMuon, held: Sequence[Holding]) -> list[dict[str, Any]]:
    """The param groups with their hyperparameters and ``params`` as FQN lists."""
    names: dict[int, list[str]] = {}
    for h in held:
        names.setdefault(h.group_index, []).append(h.fqn)
    out = []
    for gi, g in enumerate(optimizer.param_groups):
        record = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        record["params"] = names.get(gi, [])
        out.append(record)
    return out


def optimizer_state_dict(model: nn.Module, optimizer: DMuon) -> dict[str, Any]:
    """DMuon's state in the FQN-keyed, rank-symmetric form DCP saves (see the module).

    Collective: call it on every rank. :func:`dmuon.integrations.checkpoint.save`
    uses it; call it yourself to save the optimizer with your own DCP state dict.

    Args:
        model: the model the optimizer was built on.
        optimizer: the :class:`~dmuon.optim.DMuon`.

    Returns:
        ``{"state": {fqn: {key: tensor}}, "param_groups": [...]}``, the same keys on
        every rank.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> sd = optimizer_state_dict(model, DMuon(param_groups(model)))
        >>> entry = sd["state"].get("0.weight")
        >>> sorted(entry)
        ['momentum_buffer', 'step']
        >>> sd["param_groups"].pop(0).get("params")
        ['0.weight', '1.weight']
    """
    return state_to_save(optimizer, holdings(model, optimizer))


@torch.no_grad()
def state_to_save(optimizer: DMuon, held: Sequence[Holding]) -> dict[str, Any]:
    """:func:`optimizer_state_dict` for known holdings (collective, under the
    optimizer's deadline: :mod:`~dmuon.integrations.checkpoint.deadline`)."""
    with checkpoint_deadline(optimizer, "DMuon checkpoint save"):
        return _gathered_state(optimizer, held)


def _gathered_state(optimizer: DMuon, held: Sequence[Holding]) -> dict[str, Any]:
    owned = [h for h in held if h.owner is not None]
    steps = owner_steps(optimizer, owned)
    state: dict[str, dict[str, torch.Tensor]] = {}
    meshes: dict[tuple[int, str], Any] = {}
    for h in held:
        current = optimizer.state[h.param]
        if h.owner is None:  # a split matrix's shards as one DTensor (split_state.py)
            state[h.fqn] = {k: as_saved(v, h.param) for k, v in current.items()}
            continue
        if h.split:  # the owner's tp row holds it: laid out like the parameter (owned_split.py)
            state[h.fqn] = saved_entry(optimizer, h, steps[h.fqn])
            continue
        if h.experts:  # its local experts' state, on one of their replicas
            state[h.fqn] = replica_entry(optimizer, h, steps[h.fqn])
            continue
        group = optimizer.param_groups[h.group_index]
        shapes = expected_state_shapes(h, group)
        entry: dict[str, torch.Tensor] = {"step": steps[h.fqn]}
        for key, shape in shapes.items():
            if key == "step":
                continue
            value = current[key]
            full = (
                value
                if h.held_here()
                else torch.empty(shape, dtype=value.dtype, device=value.device)
            )
            if len(shape) == 0:
                work = dist.broadcast(full, group_src=h.owner, group=h.group, async_op=True)
                wait_work(work, f"broadcast of rank {h.owner}'s {key!r} of {h.fqn}", h.group)
                entry[key] = full
                continue
            mk = (id(h.group), full.device.type)
            if mk not in meshes:
                meshes[mk] = _mesh(h.group, full.device)
            what = f"scatter of rank {h.owner}'s {key!r} of {h.fqn}"
            entry[key] = scattered(full, meshes[mk], h.owner, what)
        state[h.fqn] = entry
    return {"state": state, "param_groups": group_records(optimizer, held)}


def local_expert_shapes(optimizer: DMuon, h: Holding) -> dict[str, tuple[int, ...]]:
    """The shape of each state tensor of ``h``'s expert stack on the ranks that hold its
    local experts: the rule's state of ``(E_local, m, n)``."""
    group = optimizer.param_groups[h.group_index]
    local = torch.empty(tuple(h.param.to_local().shape), device="meta")  # type: ignore[attr-defined]
    return state_shapes(get_rule(group["rule"]), matrix_layout(local, dict(group), h.fqn))


def replica_entry(optimizer: DMuon, h: Holding, step: torch.Tensor) -> dict[str, torch.Tensor]:
    """An expert stack's state held by one of its replicas over ``dp`` (``replicated``
    mode on a ``dp × ep`` mesh), broadcast from that owner over the replicas and saved as
    a DTensor laid out like the parameter
    (:func:`~dmuon.integrations.checkpoint.split_state.as_saved`): each ``ep`` column
    writes its own experts, DCP once per replica set, and any layout reads it back."""
    current = optimizer.state[h.param]
    entry: dict[str, torch.Tensor] = {"step": step}
    for key, shape in local_expert_shapes(optimizer, h).items():
        if key == "step":
            continue
        value = current[key]
        full = (
            value if h.held_here() else torch.empty(shape, dtype=value.dtype, device=value.device)
        )
        work = dist.broadcast(full, group_src=h.owner, group=h.group, async_op=True)
        wait_work(work, f"broadcast of rank {h.owner}'s {key!r} of {h.fqn}", h.group)
        entry[key] = as_saved(full, h.param)
    return entry


def scattered(full: torch.Tensor, mesh: Any, owner: int, what: str) -> torch.Tensor:
    """``full``, held by rank ``owner`` of the 1-D ``mesh``'s group, as a ``Shard(0)``
    DTensor on ``mesh``: the owner cuts it into ``torch.chunk``'s blocks of rows (as
    DTensor's ``Shard``, uneven and empty blocks included) padded with zeros to the
    largest, and one scatter hands each rank its block, waited by
    :func:`dmuon.comm.wait_work` under the current deadline (``what`` names it in the
    error). A scatter only copies, so the result is ``distribute_tensor(full, mesh,
    [Shard(0)], src_data_rank=owner)``'s bitwise, whose functional scatter has no
    deadline. The other ranks' ``full`` gives only the shape, dtype and device.

    Raises:
        dmuon.comm.CollectiveError: a rank of the group did not join in time.
    """
    from torch.distributed.tensor import DTensor, Shard

    group = mesh.get_group(0)
    n, me = int(mesh.size(0)), int(mesh.get_local_rank(0))
    rows = int(full.shape[0])
    out = full.new_empty((-(-rows // n), *full.shape[1:]))
    blocks = list(padded_chunks(full, 0, n).unbind(0)) if me == owner else None
    if out.numel() > 0:  # the shape is every rank's: all skip an empty scatter alike
        work = dist.scatter(out, blocks, group_src=owner, group=group, async_op=True)
        wait_work(work, what, group)
    local = out.narrow(0, 0, shard_range(rows, n, me)[1])
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )


def owner_steps(optimizer: DMuon, owned: Sequence[Holding]) -> dict[str, torch.Tensor]:
    """Each owned parameter's ``step`` as its owner counts it, on every rank.

    A collective; its waits run under the enclosing
    :func:`~dmuon.integrations.checkpoint.deadline.checkpoint_deadline`.
    """
    if not owned:
        return {}
    values = torch.stack(
        [
            optimizer.state[h.param]["step"].detach().to(torch.float64).reshape(())
            if h.held_here()
            else torch.zeros((), dtype=torch.float64)
            for h in owned
        ]
    )
    by_group: dict[int, list[int]] = {}
    for i, h in enumerate(owned):
        by_group.setdefault(id(h.group), []).append(i)
    for indices in by_group.values():
        group = owned[indices[0]].group
        part = values[indices].to(flag_device(group), copy=True)
        wait_work(dist.all_reduce(part, group=group, async_op=True), "all-reduce of steps", group)
        values[indices] = part.to(values.device)
    return {
        h.fqn: values[i].to(optimizer.state[h.param]["step"].dtype) for i, h in enumerate(owned)
    }


def state_targets(
    optimizer: DMuon,
    held: Sequence[Holding],
    saved_dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Fresh tensors this rank loads optimizer state into (``fqn → key → tensor``).

    An owned parameter's state is read whole by its owner and not at all by the
    others (its ``step`` by every rank); any other state has the form it has here
    (a DTensor reads its shard). A tensor-parallel matrix's state held by its owner's
    ``tp`` row is read in pieces laid out like the parameter, which
    :func:`~dmuon.integrations.checkpoint.owned_split.to_owners` gathers to the owners.

    ``saved_dtypes`` (``optim.state.<fqn>.<key>`` → dtype, from the checkpoint's
    metadata): a floating tensor is read in the dtype it was saved in, not the live
    state's, so fp32 state loaded into an optimizer built with
    ``state_dtype="bfloat16"`` is not rounded on the way (the checkpoint's groups,
    which the load restores, say fp32, and the state is rebuilt so).
    """

    def dtype(fqn: str, key: str, live: torch.dtype) -> torch.dtype:
        saved = (saved_dtypes or {}).get(f"optim.state.{fqn}.{key}")
        if saved is None or not (saved.is_floating_point and live.is_floating_point):
            return live
        return saved

    out: dict[str, dict[str, torch.Tensor]] = {}
    for h in held:
        current = optimizer.state[h.param]
        if h.owner is None:
            out[h.fqn] = {
                k: torch.empty_like(as_saved(v, h.param), dtype=dtype(h.fqn, k, v.dtype))
                for k, v in current.items()
            }
            continue
        entry = {"step": torch.empty_like(current["step"])}
        if h.split:  # every rank reads its piece; owned_split.to_owners gathers them
            for key in owner_shapes(optimizer, h):
                if key != "step":
                    live = current[key].dtype
                    entry[key] = split_target(optimizer, h, key, dtype(h.fqn, key, live))
        elif h.experts and h.held_here():  # its local experts, laid out like the parameter
            for key, shape in local_expert_shapes(optimizer, h).items():
                if key != "step":
                    v = current[key]
                    local = torch.empty(shape, dtype=dtype(h.fqn, key, v.dtype), device=v.device)
                    entry[key] = as_saved(local, h.param)
        elif h.held_here():
            shapes = expected_state_shapes(h, optimizer.param_groups[h.group_index])
            for key, shape in shapes.items():
                if key != "step":
                    v = current[key]
                    entry[key] = torch.empty(
                        shape, dtype=dtype(h.fqn, key, v.dtype), device=v.device
                    )
        out[h.fqn] = entry
    return out
