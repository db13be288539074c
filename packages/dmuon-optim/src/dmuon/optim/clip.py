"""Gradient clipping by the global norm (or by value), when gradients live on different ranks.

In owner mode each matrix's averaged gradient lives on its owner only; under FSDP2
each rank holds row shards; the scalar gradients of a DDP replacement are the
same on every rank. The global norm counts every element exactly once:

    ‖g‖_p = ( Σ_ranks Σ_{g_i counted on this rank} ‖g_i‖_p^p )^{1/p}

— each rank sums the gradients it is the one to count (the owner's matrices, its
DTensor shards on the first replica, replicated gradients on rank 0 only), and
one all-reduce of that partial sum (per mesh dimension) gives every rank the
total. In ``single`` mode with DTensor matrices (tensor or expert parallelism),
every rank counts what it holds divided by the number of ranks holding the same
values, and the partial sums are all-reduced over the world. Every rank then
scales every gradient it holds by ``min(1, max_norm / (‖g‖ + 1e-6))``, exactly as
``torch.nn.utils.clip_grad_norm_`` does on one process.

Clipping by value, ``g ← clamp(g, −c, c)`` element by element, needs no norm but
the same care: it must clamp the *averaged* gradient, so in owner mode it runs
after the reductions have finished, on the gradients the step will read.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dmuon.comm import collective_timeout, wait_work
from dmuon.comm.process_groups import group_size
from dmuon.optim.engine.params import is_dtensor, unnarrowed_norms
from dmuon.optim.engine.tensor_split import settle_pending_grad

if TYPE_CHECKING:
    from dmuon.optim.engine.base import Engine
    from dmuon.optim.optimizer import DMuon

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


@torch.no_grad()
def clip_grad_norm_(
    optimizer: DMuon,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients of ``optimizer``'s parameters by their global norm; return it.

    The distributed counterpart of :func:`torch.nn.utils.clip_grad_norm_`: the
    optimizer knows where each gradient lives (see the module docstring), so the
    norm is the norm of the averaged global gradient in every mode, computed with
    one all-reduce of per-rank partial sums (``max`` for ``norm_type=inf``). In owner
    mode it first finishes the gradient reductions (the step would wait for them
    anyway). Its collectives wait under DMuon's deadline
    (:meth:`~dmuon.optim.DMuon.collective_deadline`), as a step's do: a rank that does
    not come makes the others raise :class:`~dmuon.comm.CollectiveError`. Call it
    between ``backward()`` and ``step()`` on every rank.

    Args:
        optimizer: a :class:`~dmuon.optim.DMuon`.
        max_norm: the largest allowed norm.
        norm_type: ``p`` of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise if the norm is NaN or infinite.

    Returns:
        The total norm before clipping (a 0-D float32 tensor, the same on every rank).

    Raises:
        TypeError: ``optimizer`` is not a DMuon (``model.parameters()``, torch's
            signature), ``max_norm`` is not a real number, or ``error_if_nonfinite`` not
            a bool.
        ValueError: ``max_norm`` < 0 or ``norm_type`` ≤ 0.
        RuntimeError: a non-finite norm with ``error_if_nonfinite``.
        NotImplementedError: in sign mode (the voted step ignores the gradient scale).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, clip_grad_norm_
        >>> w = torch.nn.Parameter(torch.zeros(4, 4))
        >>> opt = DMuon([w])
        >>> w.grad = torch.full((4, 4), 1.0)  # norm 4
        >>> clip_grad_norm_(opt, 2.0).item(), round(w.grad.norm().item(), 4)
        (4.0, 2.0)
    """
    _check_optimizer(optimizer, "clip_grad_norm_(opt, max_norm)")
    max_norm = _real("max_norm", max_norm)
    if not isinstance(error_if_nonfinite, bool):  # "no" was truthy: it raised
        raise TypeError(f"error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")
    norm_type = float(norm_type)  # as torch's: 2, 2.0, float("inf") or "inf"
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be ≥ 0, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}")
    # its collectives (the reductions it finishes, the pending sums it carries out, the
    # norm's all-reduce) wait under DMuon's deadline, as a step's do
    with collective_timeout(optimizer.collective_deadline()):
        return _clip_norm(optimizer, max_norm, norm_type, error_if_nonfinite)


def _clip_norm(
    optimizer: DMuon, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """:func:`clip_grad_norm_` after its checks."""
    engine = optimizer.engine
    engine.prepare_grads()
    # A scalar's pending sum (a SequenceParallel norm's Partial gradient) is carried out
    # here once, on every rank that holds it, and left in p.grad for the step, which then
    # sums nothing again: the clip scales the sum, as one process scales its gradient.
    # Where only the ranks that count it summed it, the data-parallel replicas of a scalar
    # would step c·(g₁ + g₂) on some and c·g₁ + c·g₂ on others (a rounding apart). A
    # matrix's is carried out where the norm counts it (the ranks that step it).
    for e in engine.params:
        g = e.param.grad
        if g is not None and not e.matrix and is_dtensor(g):
            settle_pending_grad(e.param, g, e.name, engine.stats)
    counted, copies, groups = engine.norm_parts()
    # a rank that counts no gradient (it owns no matrix) must still meet the others'
    # all-reduce on their device: the parameters', not the host
    device = (
        counted[0].device
        if counted
        else next((e.param.device for e in engine.params), torch.device("cpu"))
    )
    inf = math.isinf(norm_type)
    if counted:
        if inf:
            partial = torch.stack([g.detach().abs().max().float() for g in counted]).max()
        else:
            # each norm accumulated and returned in fp32, whatever the gradient's dtype: an
            # fp16 gradient's own norm overflows past 65504 though every entry is finite
            # (64×64 entries of 1100: 70400), and an Inf total would clip it to 0
            # (a float64 gradient's in float64: the norm refuses to narrow it)
            norms = unnarrowed_norms([g.detach() for g in counted], norm_type)
            powers = torch.stack(norms).pow(norm_type)
            # a tensor several ranks count (single mode's DTensor shards) is counted 1/copies
            # times on each; copies are 1 in every other mode (x / 1.0 is exact)
            partial = (powers / torch.tensor(copies, device=powers.device)).sum()
    else:
        partial = torch.zeros((), device=device)
    partial = partial.to(torch.float32)  # all-reduced in fp32 (a 0-D float32 tensor returned)
    for pg in groups:
        if group_size(pg) > 1:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            wait_work(
                dist.all_reduce(partial, op=op, group=pg, async_op=True),
                "all-reduce of the gradient norm",
                pg,
            )
    total = partial if inf else partial.pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}; "
            "set error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = engine.local_grads()
    plain = [g for g in grads if not is_dtensor(g)]
    if plain:
        torch._foreach_mul_(plain, coef.to(plain[0].device))
    sharded = [g for g in grads if is_dtensor(g)]
    if sharded:
        factor = float(coef)  # DTensor gradients take a Python scalar
        for g in sharded:
            g.mul_(factor)
    return total


def _check_optimizer(optimizer: object, call: str) -> None:
    """Raise ``TypeError`` unless ``optimizer`` is a DMuon: torch's signature takes
    ``model.parameters()``, and an iterator or another optimizer failed with an
    ``AttributeError`` on ``.engine``."""
    from dmuon.optim.optimizer import DMuon  # this module is imported by it

    if not isinstance(optimizer, DMuon):
        what = type(optimizer).__name__
        hint = (
            ", not model.parameters() (torch.nn.utils' signature): DMuon knows where "
            "each gradient lives across ranks"
            if not isinstance(optimizer, torch.optim.Optimizer)
            else "; another optimizer's gradients are clipped with torch.nn.utils"
        )
        raise TypeError(f"call {call} with the DMuon optimizer{hint}; got a {what}")


def _real(name: str, value: object) -> float:
    """``value`` as a float: a real number or a one-element tensor, not a string or a
    bool (``float("1.0")`` took a string that a config file gave)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


@torch.no_grad()
def clip_grad_value_(optimizer: DMuon, clip_value: float) -> None:
    """Clamp every element of the gradients of ``optimizer``'s parameters to ``[−c, c]``.

    The distributed counterpart of :func:`torch.nn.utils.clip_grad_value_`,
    ``g ← clamp(g, −c, c)``: it clamps the averaged gradient, which is what one
    process clamps. In owner mode it first finishes the gradient reductions (a
    rank's local gradient is one term of the average, and clamping the terms is not
    clamping their mean), then clamps the gradients the step reads: the owners'
    reduced matrices and the scalars. Elementwise, so DTensor shards (FSDP2 rows,
    tensor-parallel shards) are clamped where they live; a gradient with a pending sum
    (``Partial``: a ``SequenceParallel`` norm's, each rank holding its share of the
    sequence) is summed first (one all-reduce over its mesh dimension) and replaced
    by the sum. Its collectives wait under DMuon's deadline
    (:meth:`~dmuon.optim.DMuon.collective_deadline`), as a step's do. Call it between
    ``backward()`` and ``step()`` on every rank.

    Args:
        optimizer: a :class:`~dmuon.optim.DMuon`.
        clip_value: ``c``, the largest allowed absolute value (≥ 0).

    Raises:
        TypeError: ``optimizer`` is not a DMuon, or ``clip_value`` not a real number.
        ValueError: ``clip_value`` < 0.
        NotImplementedError: in sign mode (the matrix gradients are never averaged).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, clip_grad_value_
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> opt = DMuon([w])
        >>> w.grad = torch.tensor([[3.0, -0.5], [-2.0, 0.25]])
        >>> clip_grad_value_(opt, 1.0)
        >>> w.grad
        tensor([[ 1.0000, -0.5000],
                [-1.0000,  0.2500]])
    """
    _check_optimizer(optimizer, "clip_grad_value_(opt, clip_value)")
    clip_value = _real("clip_value", clip_value)
    if not clip_value >= 0:
        raise ValueError(f"clip_value must be ≥ 0, got {clip_value}")
    engine = optimizer.engine
    if engine.mode == "sign":
        raise NotImplementedError(
            "clip_grad_value_ in sign mode is not supported: the matrix gradients are never "
            "averaged (each rank's momentum takes its own gradient before the vote)"
        )
    with collective_timeout(optimizer.collective_deadline()):  # as clip_grad_norm_'s
        _clamp(engine, clip_value)


def _clamp(engine: Engine, clip_value: float) -> None:
    """:func:`clip_grad_value_` after its checks."""
    engine.prepare_grads()
    # A pending sum (a SequenceParallel norm's Partial gradient: each rank's local part
    # is its share of the sequence) is carried out first, for every such gradient before
    # any is clamped: clamping the terms is not clamping their sum.
    # The sum stays in p.grad, marked for zero_grad (the step sums nothing again).
    for e in engine.params:
        g = e.param.grad
        if g is not None and is_dtensor(g):
            settle_pending_grad(e.param, g, e.name, engine.stats)
    grads = engine.local_grads()
    plain = [g for g in grads if not is_dtensor(g)]
    if plain:
        torch._foreach_clamp_min_(plain, -clip_value)
        torch._foreach_clamp_max_(plain, clip_value)
    for g in grads:
        if is_dtensor(g):
            g.clamp_(-clip_value, clip_value)
