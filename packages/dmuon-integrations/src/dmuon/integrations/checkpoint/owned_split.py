"""The optimizer state of a tensor-parallel matrix held by its owner's ``tp`` row.

In ``replicated`` mode on a ``dp × tp`` mesh and in ``sharded`` mode on FSDP2 over
tensor parallelism, a split matrix is stepped by the ``tp`` row of its owner over
``dp``: each rank of that row holds the state of its ``tp`` shard (the shape of
the split's ``local_shape``, or of the parameter's local tensor), the other ``dp``
ranks hold placeholders. A checkpoint must write every shard's state once and hand
it to the owners of the *new* plan, at any world size.

Saved, the state is a DTensor laid out like its parameter
(:func:`~dmuon.integrations.checkpoint.split_state.as_saved`), so DCP reshards it
like the weights: the owner's ``tp`` shard is broadcast over ``dp``, and each rank
keeps what its parameter holds of it (``sharded``: its FSDP2 rows of the shard;
``replicated``: the whole shard, written once by DCP's de-duplication). Loaded,
each rank reads those same pieces (:func:`split_target`), and the new owner gets its
shard back by one all-gather of the rows over ``dp`` (:func:`split_to_owner`). From a
full state dict (every rank holds the whole tensor) the owner cuts its shard out
(:func:`split_from_full`), with no collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import shard_range, wait_work
from dmuon.comm.chunk_gather import all_gather_chunks
from dmuon.integrations.checkpoint.holders import Holding
from dmuon.integrations.checkpoint.split_state import as_saved
from dmuon.optim import DMuon, get_rule
from dmuon.optim.batch_layout import state_shapes
from dmuon.optim.engine.placements import placement_of
from dmuon.optim.layout import matrix_layout
from dmuon.optim.matrix_split import local_tensor

__all__ = [
    "owner_shapes",
    "saved_entry",
    "split_from_full",
    "split_target",
    "split_to_owner",
    "split_to_save",
    "to_owners",
]


def owner_shapes(optimizer: DMuon, h: Holding) -> dict[str, tuple[int, ...]]:
    """The shape of each state tensor the owner's ``tp`` row holds for ``h`` (its shard's)."""
    split = optimizer.engine.split_of(h.param)
    assert split is not None, f"{h.fqn} is not stepped on its tensor-parallel shards"
    shape = split.local_shape or tuple(local_tensor(h.param).shape)
    group = optimizer.param_groups[h.group_index]
    layout = matrix_layout(torch.empty(shape, device="meta"), dict(group), h.fqn)
    return state_shapes(get_rule(group["rule"]), layout)


def _rows_here(h: Holding, rows: int) -> slice:
    """The rows of the owner's shard this rank's parameter holds: FSDP2's over ``dp``
    (``sharded``), or all of them (``replicated``)."""
    if not placement_of(h.param, h.fqn).sharded_split:
        return slice(0, rows)
    start, length = shard_range(rows, dist.get_world_size(h.group), dist.get_rank(h.group))
    return slice(start, start + length)


def split_to_save(optimizer: DMuon, h: Holding, key: str) -> torch.Tensor:
    """State ``key`` of ``h`` as a DTensor laid out like the parameter (collective over
    ``h.group``, under the enclosing checkpoint deadline)."""
    shape = owner_shapes(optimizer, h)[key]
    value = optimizer.state[h.param][key]
    full = (
        value.detach()
        if h.held_here()
        else torch.empty(shape, dtype=value.dtype, device=value.device)
    )
    work = dist.broadcast(full, group_src=h.owner, group=h.group, async_op=True)
    wait_work(work, f"broadcast of rank {h.owner}'s {key!r} of {h.fqn}", h.group)
    return as_saved(full[_rows_here(h, shape[0])].contiguous(), h.param)


def split_target(
    optimizer: DMuon, h: Holding, key: str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An empty DTensor, laid out as :func:`split_to_save` saves state ``key``, to load
    into (of ``dtype``, the saved one; default: the live state's)."""
    shape = owner_shapes(optimizer, h)[key]
    value = optimizer.state[h.param][key]
    rows = _rows_here(h, shape[0])
    piece = torch.empty(
        (rows.stop - rows.start, *shape[1:]),
        dtype=value.dtype if dtype is None else dtype,
        device=value.device,
    )
    return as_saved(piece, h.param)


def split_to_owner(
    optimizer: DMuon, h: Holding, key: str, loaded: torch.Tensor
) -> torch.Tensor | None:
    """The owner's shard of state ``key`` from every rank's loaded piece (``None`` on the
    other ranks). ``sharded``: one all-gather of the rows over ``dp``, padded to equal
    chunks (collective over ``h.group``); ``replicated``: the piece is the shard."""
    shape = owner_shapes(optimizer, h)[key]
    local = loaded.to_local() if hasattr(loaded, "to_local") else loaded
    if not placement_of(h.param, h.fqn).sharded_split:
        return local if h.held_here() else None
    what = f"all-gather of {h.fqn}'s {key!r} to its owner"
    whole = all_gather_chunks(local, 0, shape[0], h.group, what)
    return whole if h.held_here() else None


def _tp_block(p: torch.Tensor, name: str) -> tuple[int, int, int]:
    """``(tensor dim, start, length)`` of this rank's tensor-parallel shard of ``p``."""
    pl = placement_of(p, name)
    if pl.sharded_split:
        _, mesh_dim, dim = pl.sharded_split_dims
    else:
        mesh_dim, dim, _ = pl.shards[0]
    mesh: Any = p.device_mesh  # type: ignore[attr-defined]
    start, length = shard_range(
        int(p.shape[dim]), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    )
    return dim, start, length


def split_from_full(
    optimizer: DMuon, h: Holding, key: str, full: torch.Tensor
) -> torch.Tensor | None:
    """The owner's shard of state ``key`` cut out of the whole tensor (``None`` on the
    other ranks); per-row state of a matrix split by columns is whole on every shard."""
    if not h.held_here():
        return None
    dim, start, length = _tp_block(h.param, h.fqn)
    if dim < full.dim():
        full = full.narrow(dim, start, length)
    return full.clone()


def saved_entry(optimizer: DMuon, h: Holding, step: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every state tensor of ``h`` in its saved form, ``step`` given (collective)."""
    entry: dict[str, torch.Tensor] = {"step": step}
    for key in owner_shapes(optimizer, h):
        if key != "step":
            entry[key] = split_to_save(optimizer, h, key)
    return entry


def to_owners(
    optimizer: DMuon, held: list[Holding], loaded: Mapping[str, dict[str, torch.Tensor]]
) -> None:
    """Replace, in place, the loaded pieces of every owner-held split state by the owner's
    shard (dropped on the other ranks, which keep their placeholders). Collective."""
    for h in held:
        if not h.split:
            continue
        entry = loaded[h.fqn]
        for key in list(entry):
            if key == "step":
                continue
            mine = split_to_owner(optimizer, h, key, entry[key])
            if mine is None:
                del entry[key]
            else:
                entry[key] = mine
