"""Who holds which optimizer state: the facts both checkpoint formats are built on.

In the owner-like modes (``owner``, ``replicated``, ``sharded``) a matrix's
optimizer state lives whole on its owner rank; the other ranks hold placeholders
(empty tensors under the same keys) and a ``step`` counter they never advance.
Every other parameter's state is held by every rank: the same values (all-reduced
scalars, one process) or FSDP2's ``Shard(0)`` DTensors. A checkpoint has to save
each owner-held tensor once, from its owner, and give it to the *new* owner when
it is loaded, possibly at another world size with another plan.

Parameters are named by their fully-qualified name in the model (what
``model.named_parameters()`` says; a ``DistributedDataParallel`` wrapper's
``module.`` prefix is dropped), the names ``torch.distributed.checkpoint.state_dict``
uses, so the names survive any change of world size, mode or wrapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.optim import DMuon, get_rule
from dmuon.optim.engine import exchange_of
from dmuon.optim.engine.params import is_dtensor
from dmuon.optim.engine.placements import placement_of
from dmuon.optim.wrapper_names import WRAPPER_ATTRIBUTES

__all__ = ["Holding", "holdings", "model_fqns", "release", "settle"]


@dataclass(frozen=True, eq=False)
class Holding:
    """One parameter of the optimizer, as a checkpoint sees it.

    Attributes:
        fqn: the parameter's fully-qualified name in the model.
        param: the parameter.
        group_index: its param group.
        owner: the rank (in :attr:`group`) that holds its state whole, or ``None``
            when every rank holds its own copy (plain or a DTensor shard).
        group: the process group :attr:`owner` counts in (``None``: the world or no
            process group).
        split: the owner's ``tp`` row holds the state, each rank that of its
            tensor-parallel shard (``replicated``/``sharded``/``owner`` mode on a ``dp × tp`` mesh;
            :mod:`~dmuon.integrations.checkpoint.owned_split`). Not under a rule that
            needs whole matrices: its state is whole, the same on every rank of the row.
        experts: an expert stack split over ``ep`` whose :attr:`owner` is one of its
            replicas over :attr:`group` (``replicated`` and owner mode on a ``dp × ep``
            mesh): the
            owner holds the state of its local experts, which the other replicas of the
            same experts do not (:func:`~dmuon.integrations.checkpoint.sharded_state.
            state_to_save` broadcasts it over the replicas and saves it laid out like the
            parameter).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> opt = DMuon(param_groups(model))
        >>> first = holdings(model, opt)[0]
        >>> first.fqn, first.owner
        ('0.weight', None)
    """

    fqn: str
    param: torch.Tensor
    group_index: int
    owner: int | None
    group: Any = None
    split: bool = False
    experts: bool = False

    def held_here(self) -> bool:
        """Whether this rank holds the whole state (always, when nobody owns it)."""
        return self.owner is None or self.owner == _rank(self.group)


def _rank(group: Any) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def model_fqns(model: nn.Module) -> dict[int, str]:
    """``id(parameter) → fully-qualified name`` (a tied weight: its first name), as
    ``get_model_state_dict`` names it: without DDP's ``module.`` and without the
    wrappers of :data:`~dmuon.optim.wrapper_names.WRAPPER_ATTRIBUTES`, so a checkpoint
    saved with ``torch.compile`` or activation checkpointing loads without them, and the
    other way round.

    Examples:
        >>> import torch
        >>> from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        ...     checkpoint_wrapper,
        ... )
        >>> model = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)))
        >>> sorted(model_fqns(model).values())
        ['0.bias', '0.weight']
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    return {
        id(p): ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)
        for name, p in model.named_parameters()
    }


def holdings(model: nn.Module, optimizer: DMuon) -> list[Holding]:
    """Every parameter of ``optimizer``, in group order, with who holds its state.

    Raises:
        TypeError: ``optimizer`` is not a :class:`~dmuon.optim.DMuon`.
        ValueError: a parameter of the optimizer that is not in ``model``, a mode
            whose state cannot be checkpointed once (``sign``: every rank's momentum
            is its own), or HSDP owner mode on a mesh of part of the job.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> tuple(h.fqn for h in holdings(model, DMuon(param_groups(model))))
        ('0.weight', '1.weight', '0.bias', '1.bias')
    """
    if not isinstance(optimizer, DMuon):
        raise TypeError(
            f"optimizer must be a dmuon.optim.DMuon, got {type(optimizer).__name__}; for "
            "other optimizers use torch.distributed.checkpoint.state_dict directly"
        )
    engine = optimizer.engine
    if engine.mode == "sign":
        raise ValueError(
            "mode='sign' keeps a different momentum on every rank (Sign-Muon votes on "
            "local momenta), so there is no single optimizer state to save or reshard; "
            "save opt.state_dict() on every rank (each rank's own, loaded back on that rank), "
            "or train with another rule (e.g. rule='muon') in mode='owner'/'replicated'/"
            "'sharded' (rule='sign_muon' runs in mode='sign', 'sharded' or one process)"
        )
    exchange: Any = getattr(engine, "exchange", None)
    # HSDP owner mode: an owner is a slot of the 2-D mesh, named by its global rank over
    # the world (the state is saved and loaded over every rank of the job)
    hsdp = exchange is not None and exchange.replicate_group is not None
    if hsdp and exchange.world_size != dist.get_world_size():
        raise ValueError(
            f"checkpointing HSDP owner mode on a mesh of {exchange.world_size} of the job's "
            f"{dist.get_world_size()} ranks is not supported: dedicate over a mesh of every "
            "rank, or train stock HSDP (fully_shard on the 2-D mesh without dedicate: DMuon "
            "runs in sharded mode, whose checkpoints save and reshard)"
        )
    names = model_fqns(model)
    out: list[Holding] = []
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            fqn = names.get(id(p))
            if fqn is None:
                raise ValueError(
                    f"parameter {i} of param group {gi} (shape {tuple(p.shape)}) is not a "
                    "parameter of the model given; pass the model the optimizer was built on "
                    "(after fully_shard, if FSDP2 is used)"
                )
            owner: int | None = None
            # a rule that needs whole matrices keeps whole state on the owner's tp row
            # (the shards gathered): saved as any owner's, once per tp column alike
            splits = engine.split_of(p) is not None and get_rule(group["rule"]).splits
            if exchange is not None:  # owner mode (over dp × tp: the owner's tp row)
                held_by = engine.expert_owner(p)  # an expert stack's owner among its replicas
                if held_by is not None:
                    out.append(Holding(fqn, p, gi, held_by[0], held_by[1], experts=True))
                    continue
                dedicated = exchange_of(p)
                if dedicated is not None and dedicated is exchange:
                    name = dedicated.name_of(p)
                    owner = dedicated.owner(name) if name is not None else None
                split = owner is not None and splits
                if hsdp:  # no tensor parallelism beside HSDP (dedicate refuses it)
                    slot = owner
                    owner = exchange.slot_ranks[slot] if slot is not None else None
                    out.append(Holding(fqn, p, gi, owner, None, False))
                    continue
                out.append(Holding(fqn, p, gi, owner, exchange.group, split))
                continue
            owner_of = getattr(engine, "owner_of", None)
            if owner_of is not None and engine.world_size > 1:
                owner = owner_of(p)
            split = owner is not None and splits
            experts = owner is not None and _expert_split(p, group)
            group_of = getattr(engine, "group", None)
            out.append(Holding(fqn, p, gi, owner, group_of, split, experts))
    seen: dict[str, int] = {}
    for h in out:
        if h.fqn in seen:
            raise ValueError(
                f"parameter {h.fqn!r} is in param groups {seen[h.fqn]} and {h.group_index}"
            )
        seen[h.fqn] = h.group_index
    return out


def _expert_split(p: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether ``p`` is an expert stack (``flatten=False``) split along its expert
    dimension (:attr:`~dmuon.optim.engine.placements.MatrixPlacement.expert_split`)."""
    if not is_dtensor(p) or p.dim() <= 2 or group.get("flatten", True):
        return False
    return placement_of(p, "", stack=True).expert_split


def settle(optimizer: DMuon) -> None:
    """Wait for the owners' last published weights (owner mode), so every rank's
    parameters are current before they are read or overwritten.

    Under ``reshard_after_forward`` this materialises every layer; call
    :func:`release` after.
    """
    exchange = getattr(optimizer.engine, "exchange", None)
    if exchange is not None:
        exchange.wait_all_published()


def release(optimizer: DMuon) -> None:
    """Undo :func:`settle`'s materialisation under ``reshard_after_forward``."""
    exchange = getattr(optimizer.engine, "exchange", None)
    if exchange is not None and exchange.reshard_after_forward:
        exchange.publication.release_all()
