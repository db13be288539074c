"""MuonBP: orthogonalise blocks most steps and the full matrix every P-th step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, integer, matrix_keys, real
from dmuon.optim.scaling import adjust_lr_factor
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["BlockPeriodicOrthogonalize", "block_bounds"]


def block_bounds(size: int, blocks: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``blocks`` near-equal parts of ``range(size)``.

    The first ``size % blocks`` parts get one extra element — the layout of
    ``torch.tensor_split`` — so ragged shards (FSDP pads the last one) map to
    blocks directly. Empty parts are dropped.

    Examples:
        >>> block_bounds(10, 3)
        [(0, 4), (4, 7), (7, 10)]
        >>> block_bounds(3, 2**62)  # more blocks than rows: one row each
        [(0, 1), (1, 2), (2, 3)]
    """
    base, extra = divmod(size, blocks)
    out, start = [], 0
    # parts past the size-th are empty (dropped): not looped over, so row_blocks=2**62
    # gives the size one-row blocks at once instead of iterating for ever
    for i in range(min(blocks, size)):
        stop = start + base + (1 if i < extra else 0)
        if stop > start:
            out.append((start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class BlockPeriodicOrthogonalize(Transform):
    """MuonBP: ``O = NS(X)`` on step ``t ≡ 0 (mod P)``, else ``O_ij = NS(X_ij)`` per block.

    A whole matrix is cut into ``row_blocks × col_blocks`` blocks ``X_ij``. A matrix
    split over a tensor-parallel group (``ctx.split``) is cut into its shards instead,
    as in the paper: a block step orthogonalises this rank's shard alone, with no
    communication, and a full step takes the split path of
    :meth:`~dmuon.optim.transforms.StepContext.orthogonalize` (``row_blocks`` and
    ``col_blocks`` do not apply; one process with the shards as its blocks steps the
    same; that holds in every mode, owner mode on a ``dp × tp`` mesh included: its
    owner's ``tp`` row steps the shards). Whole matrices — one process, the owner modes
    without tensor parallelism, FSDP2's ``sharded`` mode, which gather each matrix on
    its owner — take the explicit blocks. Each update is scaled with the ``adjust_lr``
    factor of the matrix it orthogonalised — the block's shape on
    block steps, the full shape on full steps — times ``block_lr_scale`` or
    ``full_lr_scale`` (the paper's two step sizes η_block and η_full, relative to
    the group's lr). ``P = 1`` is Muon; ``P`` larger than the run is BlockMuon.
    Blocks of the same shape are orthogonalised in one batched call.

    Source: Khaled, Ozkara, Yu, Hong, Park, *MuonBP: Faster Muon via
    Block-Periodic Orthogonalization*, arXiv 2510.16981. The paper's default period
    and its η_block/η_full relation were not available; the defaults are ours.

    Hyperparameters: ``period`` (P), ``row_blocks``, ``col_blocks``,
    ``block_lr_scale``, ``full_lr_scale``, ``adjust_lr``.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import BlockPeriodicOrthogonalize, StepContext
        >>> hp = dict(period=2, row_blocks=2, col_blocks=1, block_lr_scale=1.0,
        ...           full_lr_scale=1.0, adjust_lr=None, ns_method="standard",
        ...           ns_coefficients="polar_express", ns_steps=5, ns_compute_dtype="float32")
        >>> X = torch.randn(1, 8, 16)
        >>> O = BlockPeriodicOrthogonalize()(X, {}, StepContext(grad=X, hp=hp, step=1))
        >>> O.shape
        torch.Size([1, 8, 16])
    """

    # a split matrix's blocks are its shards: block steps stay on this rank, full steps
    # reach the whole matrix through ctx.orthogonalize and ctx.matrix_shape
    splits: ClassVar[bool] = True

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "period": Option(5, integer(1), "a full orthogonalisation every P steps"),
        "row_blocks": Option(2, integer(1), "blocks along the rows (a split matrix: its shards)"),
        "col_blocks": Option(1, integer(1), "blocks along the columns"),
        "block_lr_scale": Option(1.0, real(0.0), "η_block / lr"),
        "full_lr_scale": Option(1.0, real(0.0), "η_full / lr"),
        **matrix_keys("adjust_lr", "ns_method", "ns_coefficients", "ns_steps", "ns_compute_dtype"),
    }

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        hp = ctx.hp
        if ctx.step % int(hp["period"]) == 0:
            m, n = ctx.matrix_shape  # the whole matrix's, split or not
            ctx.scale *= adjust_lr_factor(hp["adjust_lr"], m, n) * float(hp["full_lr_scale"])
            return ctx.orthogonalize(X)
        m, n = X.shape[-2], X.shape[-1]
        if ctx.split is not None:  # the block is this rank's shard
            if X.numel() == 0:  # an empty shard (an uneven split): nothing to step
                return X.clone()
            ctx.scale *= adjust_lr_factor(hp["adjust_lr"], m, n) * float(hp["block_lr_scale"])
            return replace(ctx, split=None).orthogonalize(X)
        rows = block_bounds(m, int(hp["row_blocks"]))
        cols = block_bounds(n, int(hp["col_blocks"]))
        by_shape: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        for r0, r1 in rows:
            for c0, c1 in cols:
                by_shape.setdefault((r1 - r0, c1 - c0), []).append((r0, r1, c0, c1))
        factors = {
            shape: adjust_lr_factor(hp["adjust_lr"], *shape) * float(hp["block_lr_scale"])
            for shape in by_shape
        }
        uniform = len(set(factors.values())) == 1
        out = torch.empty_like(X)
        for shape, blocks in by_shape.items():
            stacked = torch.stack([X[:, r0:r1, c0:c1] for r0, r1, c0, c1 in blocks], dim=1)
            O = ctx.orthogonalize(stacked.reshape(-1, *shape)).reshape(stacked.shape)
            if not uniform:
                O = O * factors[shape]
            for j, (r0, r1, c0, c1) in enumerate(blocks):
                out[:, r0:r1, c0:c1] = O[:, j]
        if uniform:
            ctx.scale *= next(iter(factors.values()))
        return out
