"""The container's state dict: DMuon's sharded state, in the form DCP saves and reshards.

torchtitan's checkpointer puts the container in its DCP state dict as a
``Stateful``: DCP calls :meth:`state_dict` to save, and to load it calls
:meth:`state_dict` for the tensors to read into, reads them, then calls
:meth:`load_state_dict` with them. Both calls therefore return the *saved* form,
:func:`dmuon.integrations.checkpoint.optimizer_state_dict`'s::

    {"state": {fqn: {"step": tensor, "momentum_buffer": tensor, ...}},
     "param_groups": [{"lr": ..., "rule": "muon", ..., "params": [fqn, ...]}]}

the same keys on every rank; a tensor one owner holds whole is a ``Shard(0)``
DTensor over the owners' group, so DCP writes it once and reads it back at any world
size. :func:`load_container_state` turns what DCP read into what each rank of the
*new* plan holds: the owner of a matrix takes the whole tensor (gathered from the
``Shard(0)`` rows, one tensor at a time), the other ranks keep their placeholders; a
tensor-parallel matrix's pieces go to its owner's ``tp`` row; FSDP2-sharded state
stays in its shards. This is :func:`dmuon.integrations.checkpoint.load`'s second
phase with DCP's read done by torchtitan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dmuon.integrations.checkpoint.compat import CheckpointMismatchError, load_into_optimizer
from dmuon.integrations.checkpoint.deadline import checkpoint_deadline
from dmuon.integrations.checkpoint.holders import Holding, holdings, release, settle
from dmuon.integrations.checkpoint.owned_split import to_owners
from dmuon.integrations.checkpoint.sharded_state import state_to_save
from dmuon.integrations.checkpoint.whole import whole_tensor
from dmuon.optim import DMuon

__all__ = ["container_state", "load_container_state"]


@torch.no_grad()
def container_state(model: nn.Module, optimizer: DMuon) -> dict[str, Any]:
    """DMuon's state in the saved form (module docstring). Collective over every rank."""
    held = holdings(model, optimizer)
    settle(optimizer)
    try:
        return state_to_save(optimizer, held)
    finally:
        release(optimizer)


def _held_values(
    held: Sequence[Holding], saved: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """What each rank keeps of the loaded tensors (collective: owners gather rows)."""
    missing = [h.fqn for h in held if h.fqn not in saved]
    if missing:
        raise CheckpointMismatchError(
            [f"no optimizer state for {fqn!r} in the checkpoint" for fqn in missing[:8]]
        )
    out: dict[str, dict[str, torch.Tensor]] = {}
    for h in held:
        entry = dict(saved[h.fqn])
        if h.owner is not None and not h.split:
            # Shard(0) rows over the owners' group → the whole tensor at its owner.
            # Every rank of the group gathers in the same (holdings) order.
            kept = {"step": entry["step"]}
            for key, value in entry.items():
                if key == "step":
                    continue
                whole = whole_tensor(value, f"{h.fqn}.{key}")  # under the load's deadline
                if h.held_here():
                    kept[key] = whole
            entry = kept
        out[h.fqn] = entry
    return out


@torch.no_grad()
def load_container_state(model: nn.Module, optimizer: DMuon, state_dict: Mapping[str, Any]) -> None:
    """Give ``state_dict`` (:func:`container_state`'s form, as DCP loaded it) to
    ``optimizer``. Collective over every rank.

    Raises:
        CheckpointMismatchError: a parameter of the optimizer has no state in it, or
            the groups differ in number.
    """
    groups = list(state_dict.get("param_groups") or [])
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            [
                f"the checkpoint has {len(groups)} param group(s), the optimizer "
                f"{len(optimizer.param_groups)}"
            ]
        )
    held = holdings(model, optimizer)
    settle(optimizer)
    try:
        with checkpoint_deadline(optimizer, "DMuon checkpoint load (torchtitan)"):
            values = _held_values(held, state_dict.get("state") or {})
            to_owners(optimizer, held, values)  # tensor-parallel pieces to the owners' row
        load_into_optimizer(optimizer, held, values, groups)
    finally:
        release(optimizer)
