"""fp16 loss scaling (``torch.amp``) with DMuon: unscale the gradients the step reads.

A loss scaler multiplies the loss by ``s`` so that fp16 gradients do not underflow;
before the step the gradients are divided by ``s`` and searched for Inf/NaN
(``unscale_``), a step with one is skipped and ``s`` lowered, and ``s`` grows again
after ``growth_interval`` clean steps (``update``)::

    g ← g / s,    skip ⇔ ∃ non-finite g,    s ← s·backoff if skip, s·growth after N clean steps

Every rank must take the same decisions, or the ranks' scales drift apart and their
gradients are averaged at different scales. Under DDP this holds because the
gradients are all-reduced during backward. In owner mode it does not: each matrix's
gradient leaves for its owner during backward, so ``scaler.unscale_(opt)`` right
after backward would divide this rank's local copies, which the step no longer
reads, and look for an Inf in them only. In ``sign`` mode each rank's gradients are
its own (never averaged), so a plain scaler finds an Inf on one rank alone.
:func:`unscale_` first finishes the reductions
(:meth:`~dmuon.optim.engine.Engine.prepare_grads`), then lets the scaler
unscale the gradients this rank holds — its owned matrices, the scalar parameters —
with :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`, whose
``unscale_`` sums the Inf flags over its process group: every rank then skips, and
scales, alike. ``DMuon.step`` (which a scaler calls on every rank in these two modes,
``_step_supports_amp_scaling``) skips the step on every rank when a scaler found an
Inf — the skip travels in the step's agreement, so one rank's is every rank's —
finishing its communication, and refuses a step whose gradients were not unscaled
this way (:func:`scaler_skips`).

Source: ``torch.amp.GradScaler`` and FSDP's ``ShardedGradScaler`` (Micikevicius et
al., *Mixed Precision Training*, ICLR 2018, for dynamic loss scaling).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dmuon.optim.engine.base import Engine
from dmuon.optim.engine.params import is_dtensor

__all__ = ["AGREED_MODES", "scaler_skips", "scaler_unscaled", "unscale_"]

AGREED_MODES = ("owner", "sign")
"""The modes whose ranks hold different gradients at the step (owner mode: each its own
matrices' averages; sign: each its own local gradients), so that a loss scaler's Inf
flags must be summed over the ranks (``ShardedGradScaler``) and its steps go through
:func:`unscale_`."""

# What the refusals of an owner-mode step say to do instead.
_RECIPE = (
    "Use ShardedGradScaler (torch.distributed.fsdp.sharded_grad_scaler) and unscale "
    "through the optimizer: scaler.scale(loss).backward(); opt.unscale_(scaler); [clip]; "
    "scaler.step(opt); scaler.update() (after this refusal, scaler.update() or a new "
    "scaler before the next iteration)"
)


def unscale_(
    engine: Engine, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> None:
    """``scaler.unscale_(optimizer)`` on the gradients the step of ``engine`` reads.

    ``optimizer`` is the DMuon that ``engine`` steps (``DMuon.unscale_`` passes both).

    Finishes the gradient reductions first (owner mode: each matrix's averaged
    gradient is then on its owner, the other ranks' ``p.grad`` is ``None``), then
    calls the scaler's ``unscale_``. In owner and ``sign`` mode (:data:`AGREED_MODES`)
    ``scaler`` must be a
    :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` over
    every rank of the training (its default, the world): its ``unscale_`` sums the
    Inf flags of the ranks, so they all skip a step, and back off, together; a plain
    ``torch.amp.GradScaler`` would see this rank's gradients only. ``replicated`` and
    ``single`` mode under DDP take either scaler (their gradients are all-reduced,
    the same on every rank); ``sharded`` mode's DTensor gradients have their Inf flags
    reduced by DTensor itself.

    Owner mode with DTensor parameters (FSDP2's scalars next to the owners' plain
    matrices, tensor-parallel shards) is not served: torch's scalers unscale all the
    gradients of one device and dtype in one foreach call, which cannot mix DTensors
    with plain tensors, or DTensors of different meshes.

    Raises:
        TypeError: ``scaler`` is no ``torch.amp.GradScaler``, or (owner, ``sign`` mode)
            not a ``ShardedGradScaler``; nothing was changed.
        NotImplementedError: owner mode with DTensor parameters; nothing was changed.
        ValueError: (owner, ``sign`` mode) a ``ShardedGradScaler`` over fewer ranks than
            the world; nothing was changed.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # FSDP's, lazily

    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if engine.mode in AGREED_MODES and not isinstance(scaler, ShardedGradScaler):
        held = (
            "the averaged gradients of the matrices it owns"
            if engine.mode == "owner"
            else "its own local gradients"
        )
        raise TypeError(
            f"{engine.mode} mode needs a ShardedGradScaler, got {type(scaler).__name__}: "
            f"each rank holds {held} only, so a GradScaler would find an Inf on that rank "
            "alone, and the ranks would skip steps and scale their losses differently. "
            "ShardedGradScaler sums the Inf flags over its process group (default: the "
            "world). Nothing was changed"
        )
    if engine.mode in AGREED_MODES:
        sharded = next((e.name for e in engine.params if is_dtensor(e.param)), None)
        if sharded is not None:
            raise NotImplementedError(
                f"fp16 loss scaling in {engine.mode} mode with DTensor parameters ({sharded!r}; "
                "FSDP2 or tensor parallelism): torch's scalers unscale a device's gradients in "
                "one foreach call, which cannot mix DTensors with the owners' plain gradients. "
                "Train in bf16 (no scaler), or dedicate with dmuon.integrations.ddp. Nothing "
                "was changed"
            )
    if engine.mode in AGREED_MODES and dist.is_available() and dist.is_initialized():
        covered = dist.get_world_size(scaler.process_group)  # type: ignore[attr-defined]
        if covered != dist.get_world_size():
            raise ValueError(
                f"the ShardedGradScaler's process_group spans {covered} of the "
                f"{dist.get_world_size()} ranks (-1: not this one): its Inf flags and so "
                "its scale updates would differ between ranks, and the gradients would be "
                "averaged at different scales. Give it the world (its default). Nothing "
                "was changed"
            )
    engine.prepare_grads()
    scaler.unscale_(optimizer)


def scaler_skips(optimizer: Any, *, unscaled: bool, mode: str) -> bool:
    """Whether this rank's loss scaler asks to skip this step (:data:`AGREED_MODES`);
    refuse what cannot be served.

    Called by ``DMuon.step`` when a ``GradScaler.step`` has set ``optimizer.found_inf``
    and ``optimizer.grad_scale`` (it does so on every rank in :data:`AGREED_MODES`).
    ``unscaled``: the gradients were unscaled this step by :func:`unscale_` (through
    ``DMuon.unscale_``). A refusal is the same on every rank (what the loop called is
    the same everywhere) and removes the two attributes (the scaler, interrupted, does
    not); ``DMuon.step`` then skips the step on every rank, finishing its
    communication so that the optimizer stays usable, and raises it.

    Raises:
        RuntimeError: the scaler would have the step unscale the gradients itself
            (``grad_scale`` is set: ``unscale_`` was not called), or the gradients
            were unscaled by ``scaler.unscale_(opt)`` before their reductions
            finished. Nothing was updated.
    """
    grad_scale = getattr(optimizer, "grad_scale", None)
    if grad_scale is None and unscaled:
        return bool(optimizer.found_inf)  # the step's agreement makes any rank's skip all
    for attribute in ("found_inf", "grad_scale"):
        optimizer.__dict__.pop(attribute, None)
    if grad_scale is not None:
        why = (
            "scaler.step(opt) was called on still-scaled gradients (no unscale before it), "
            "and the scaler's own search for an Inf would look at this rank's gradients "
            "alone"
        )
    else:
        why = (
            "scaler.unscale_(opt) was called directly: it unscales this rank's local "
            "gradients (in owner mode before their reductions to the owners finished, the "
            "owners' averaged gradients staying scaled) and finds an Inf on this rank alone"
        )
    raise RuntimeError(
        f"DMuon's {mode!r} mode cannot take this loss-scaled step: {why}. {_RECIPE}. "
        "Nothing was updated"
    )


def scaler_unscaled(
    optimizer: torch.optim.Optimizer, scaler_ref: weakref.ref[torch.amp.GradScaler] | None
) -> bool:
    """Whether the scaler that unscaled ``optimizer``'s gradients has not yet stepped it
    or updated since (``True`` where that cannot be read).

    torch's scalers offer no public way to ask this, and on a skipped step they never
    call the optimizer, so this reads ``GradScaler._per_optimizer_states`` (keyed by
    ``id(optimizer)``; its ``"stage"``: ``OptState.UNSCALED`` after ``unscale_``,
    ``STEPPED`` after ``step``, the entry gone after ``update``), stable since torch
    1.6 and the same in FSDP's ``ShardedGradScaler``. Guarded: a scaler freed,
    disabled (its ``unscale_`` records nothing) or without that record answers
    ``True``, the step count alone deciding, as before this check.
    """
    scaler = scaler_ref() if scaler_ref is not None else None
    if scaler is None or not scaler.is_enabled():
        return True
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, Mapping):
        return True
    state = states.get(id(optimizer))  # .get: a defaultdict must not grow an entry here
    stage = state.get("stage") if isinstance(state, Mapping) else None
    unscaled_stage = getattr(getattr(torch.amp.grad_scaler, "OptState", None), "UNSCALED", None)
    if unscaled_stage is None:
        return True
    return stage is unscaled_stage
