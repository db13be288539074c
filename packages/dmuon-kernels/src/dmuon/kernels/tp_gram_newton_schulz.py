"""Gram Newton–Schulz on the shards of a tensor-parallel matrix, without gathering it.

Every Newton–Schulz step multiplies ``X`` on the left by a polynomial in its Gram
matrix, ``X' = (aI + bR + cR²) X`` with ``R = X Xᵀ``, so after ``k`` steps
``X_k = Q_k X_0`` with ``Q_k`` built from ``R`` alone (Gram Newton–Schulz: Zhang,
Amsel, Chen, Dao 2026). Split ``X`` by columns over the ``t`` ranks of a tensor-
parallel group, ``X = [X_1 | … | X_t]``. Then

    R = X Xᵀ = Σ_i X_i X_iᵀ        and        Q X = [Q X_1 | … | Q X_t],

so one all-reduce of the ``m × m`` Gram matrix at the start and at each restart is
all the iteration needs: every rank forms ``Q`` from the summed ``R`` and updates
its own shard. No rank holds the whole matrix, and the ``m × m`` work is repeated
on each rank while the ``m × n`` products are divided by ``t``. A matrix split by
rows runs on its transpose (``polar(Gᵀ) = polar(G)ᵀ``), where the split is again
by columns and the Gram matrix is ``GᵀG``: the side of the Gram matrix is always
the *unsplit* dimension.

Traffic per matrix, in the compute dtype of ``b`` bytes, with ``r`` restarts:
``(r + 1)`` all-reduces of ``s² · b`` bytes (``s`` the unsplit side) plus the
normalisation's two (below), against ``(t − 1)/t · m n · b_x`` to gather the shards, in the dtype of
their ``b_x`` bytes (not the compute dtype), and as much to scatter the result: the
Gram path wins when ``s`` is the short side.

The normalisation is the one of :func:`~dmuon.kernels.gram_newton_schulz`,
``X = G / (‖G‖_F + eps · max|G|)``, with the maximum and the squared norm reduced
over the shards: a ``"max"`` of one number per matrix, then a ``"sum"`` of one per
matrix and the split dimension's size — for a batch of ``B`` matrices ``B`` and
``B + 1`` entries, in fp32 (fp64 for fp64 shards), whatever the compute dtype.

When the Gram side is the *long* side (a wide matrix split by rows, a tall one by
columns), ``R`` is rank-deficient and evolving it between restarts amplifies the
rounding in its null space: on a 48×160 matrix split by rows the result is 20 % off
in bf16 with the single restart that suffices otherwise, 3 % when ``R`` is
recomputed at every step. By default such a matrix therefore restarts at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dmuon.kernels._layout import check_matrix_input
from dmuon.kernels.coefficients import resolve_coefficients
from dmuon.kernels.compute_dtype import default_compute_dtype
from dmuon.kernels.gram_newton_schulz import gram_iterations
from dmuon.kernels.ns_options import DEFAULTS, check_restarts, default_restarts
from dmuon.kernels.symmetric_ops import TORCH_OPS, SymmetricOps

__all__ = ["REDUCE_OPS", "tp_gram_newton_schulz"]

REDUCE_OPS = ("sum", "max")
"""What ``reduce`` is asked for: an elementwise sum or maximum over the shards."""

Reduce = Callable[[torch.Tensor, str], "torch.Tensor | None"]


def tp_gram_newton_schulz(
    shard: torch.Tensor,
    *,
    split_dim: int,
    reduce: Reduce,
    coefficients: str | Sequence[Sequence[float]] = DEFAULTS.coefficients,
    steps: int = DEFAULTS.steps,
    restarts: Sequence[int] | None = None,
    eps: float = DEFAULTS.eps,
    compute_dtype: torch.dtype | None = DEFAULTS.compute_dtype,
    ops: SymmetricOps = TORCH_OPS,
) -> torch.Tensor:
    """This rank's shard of the Gram Newton–Schulz polar factor of a split matrix.

    The whole matrix ``G`` (or batch ``(..., rows, cols)``) is split along
    ``split_dim`` over the ranks of a group, any sizes (uneven and empty shards
    included); ``shard`` is this rank's part. Every rank calls this function with
    its shard, the same arguments and a ``reduce`` that combines a tensor over the
    group, and gets its shard of ``gram_newton_schulz(G)``. With an identity
    ``reduce`` on a whole matrix it *is* :func:`~dmuon.kernels.gram_newton_schulz`
    (to rounding; a square matrix runs the Gram iteration here, the standard one
    there).

    Args:
        shard: this rank's ``(..., rows_i, cols)`` (``split_dim=-2``) or
            ``(..., rows, cols_i)`` (``split_dim=-1``) real floating tensor.
        split_dim: the dimension ``G`` is split along: ``-1`` / ``ndim - 1``
            (columns) or ``-2`` / ``ndim - 2`` (rows).
        reduce: ``reduce(tensor, op)`` with ``op`` in :data:`REDUCE_OPS` returns the
            elementwise ``"sum"`` or ``"max"`` of ``tensor`` over the group (it may
            work in place and return None), e.g. torch's distributed ``all_reduce``
            on the tensor-parallel process group, given ``op`` as a ``ReduceOp``:
            ``lambda t, op: dist.all_reduce(t, {"sum": ReduceOp.SUM, "max":
            ReduceOp.MAX}[op], group=tp)`` (dmuon-kernels itself holds no distributed
            code). It is called ``3 + len(restarts)``
            times, in the same order on every rank.
        restarts: iterations at which ``X`` is re-formed and ``R`` recomputed (and
            reduced) exactly. ``None``: one restart
            (:func:`~dmuon.kernels.ns_options.default_restarts`: at 2, at 3 in bf16)
            when the Gram side (the unsplit dimension) is the short side of the whole
            matrix, every step
            ``(1, …, steps − 1)`` when it is the long side (see above).
        coefficients: as for :func:`~dmuon.kernels.gram_newton_schulz`.
        steps: as for :func:`~dmuon.kernels.gram_newton_schulz`.
        eps: as for :func:`~dmuon.kernels.gram_newton_schulz` (relative to the largest
            entry of the whole matrix).
        compute_dtype: as for :func:`~dmuon.kernels.gram_newton_schulz`.
        ops: the symmetric products (:data:`~dmuon.kernels.TORCH_OPS`, or the Triton
            kernels' set from :mod:`dmuon.kernels.triton`).

    Returns:
        A tensor shaped and typed like ``shard``.

    Examples:
        >>> import torch
        >>> G = torch.randn(64, 256)
        >>> whole = lambda t, op: t  # one rank: the shard is the whole matrix
        >>> O = tp_gram_newton_schulz(G, split_dim=-1, reduce=whole,
        ...                           compute_dtype=torch.float32)
        >>> O.shape
        torch.Size([64, 256])
    """
    check_matrix_input(shard, "shard")
    ndim = shard.ndim
    if isinstance(split_dim, bool) or split_dim not in (-1, -2, ndim - 1, ndim - 2):
        raise ValueError(
            f"split_dim must be -1 (columns) or -2 (rows) of the {ndim}-dimensional shard "
            f"of shape {tuple(shard.shape)}, got {split_dim!r}"
        )
    if not callable(reduce):
        raise ValueError(f"reduce must be a callable reduce(tensor, op), got {reduce!r}")
    schedule = resolve_coefficients(coefficients, steps)
    if restarts is not None:
        check_restarts(restarts, steps)
    dtype = (
        compute_dtype if compute_dtype is not None else default_compute_dtype(shard.device, "gram")
    )

    rows, cols = shard.shape[-2], shard.shape[-1]
    by_rows = split_dim % ndim == ndim - 2
    X = shard.reshape(math.prod(shard.shape[:-2]), rows, cols)  # -1 is ambiguous if empty
    if by_rows:  # work on the transpose: its split is by columns
        X = X.mT
    work = torch.float64 if shard.dtype == torch.float64 else torch.float32
    X = X.to(work).contiguous()
    # Normalise in fp32 before the cast down, with the scale of the whole matrix:
    # divide by the largest entry (reduced "max") so the squared norm cannot overflow
    # or underflow, then by ‖·‖_F (reduced "sum" of the squares) plus eps.
    if X.numel():
        local_max = X.abs().amax(dim=(-2, -1))
    else:  # an empty shard of an uneven split still takes part in every reduction
        local_max = X.new_zeros(X.shape[0])
    scale = _checked(reduce(local_max, "max"), local_max, "max")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    X = X / scale[:, None, None]
    # The squared norms, and the split dimension's whole size (its last entry), which
    # every rank needs to take the same restart schedule.
    local = torch.cat([X.square().sum(dim=(-2, -1)), X.new_tensor([X.shape[-1]])])
    summed = _checked(reduce(local, "sum"), local, "sum")
    norm, split_size = summed[:-1].sqrt(), int(summed[-1].item())
    X = (X / (norm + eps)[:, None, None]).to(dtype).contiguous()
    gram_side = X.shape[-2]
    if restarts is None:
        restarts = (
            tuple(range(1, steps)) if gram_side > split_size else default_restarts(steps, dtype)
        )
    restarts_t = check_restarts(restarts, steps)

    def gram(Y: torch.Tensor) -> torch.Tensor:
        R = ops.syrk(Y)
        return _checked(reduce(R, "sum"), R, "sum")

    X = gram_iterations(X, schedule, restarts_t, ops, gram)
    if by_rows:
        X = X.mT
    return X.to(shard.dtype).reshape(shard.shape)


def _checked(result: torch.Tensor | None, sent: torch.Tensor, op: str) -> torch.Tensor:
    """The reduced tensor: what ``reduce`` returned, or ``sent`` when it worked in place."""
    out = sent if result is None else result
    if not isinstance(out, torch.Tensor) or out.shape != sent.shape:
        raise ValueError(
            f"reduce(tensor, {op!r}) must return the reduced tensor of shape "
            f"{tuple(sent.shape)} (or None after reducing in place), got "
            f"{type(out).__name__}{'' if not isinstance(out, torch.Tensor) else tuple(out.shape)}"
        )
    return out
