"""A matrix split over a group of ranks (tensor parallelism), as the rule chain sees it.

A tensor-parallel layer holds each weight matrix as shards: ``ColwiseParallel``
splits an ``nn.Linear`` weight ``(out, in)`` by rows (``Shard(0)``),
``RowwiseParallel`` by columns (``Shard(1)``). Orthogonalising a shard as if it
were the whole matrix is silently wrong. With the shard, the dimension it is split
along, the whole matrix's shape and a ``reduce`` that sums (or takes the maximum
of) a tensor over the group, every transform of a chain can do what it does to the
whole matrix:

* elementwise links (momentum, sign, Adam-style preconditioning) act on the shard
  as they would on the whole;
* the polar factor comes from
  :func:`dmuon.kernels.tp_gram_newton_schulz`, which all-reduces only the small
  Gram matrix and never gathers the shards (:meth:`StepContext.orthogonalize
  <dmuon.optim.transforms.StepContext.orthogonalize>`);
* shape factors (``adjust_lr``, a norm ball's radius) use the whole shape
  (:attr:`StepContext.matrix_shape <dmuon.optim.transforms.StepContext.matrix_shape>`).

A transform says whether it computes correctly on a shard
(:attr:`Transform.splits <dmuon.optim.transforms.Transform.splits>`); a rule runs on
split matrices only when every link does (:attr:`Rule.splits
<dmuon.optim.Rule.splits>`). This module holds no distributed code: the engine
builds ``reduce`` from the parameter's device mesh
(:mod:`dmuon.optim.engine.tensor_split`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

__all__ = ["MatrixSplit", "local_tensor"]


@dataclass(frozen=True)
class MatrixSplit:
    """How every matrix of a batch is split over the ranks of a group.

    Attributes:
        dim: the matrix dimension the shards split: ``-2`` (rows) or ``-1`` (columns).
        shape: the whole matrix's ``(m, n)``.
        reduce: ``reduce(tensor, op)`` with ``op`` ``"sum"`` or ``"max"``: the
            elementwise reduction of ``tensor`` over the group (in place; it may
            return None), called in the same order on every rank of the group.
        group: what identifies the group (matrices of the same whole shape, split
            and group are batched together); e.g. ``("tp", (0, 1))``.
        local_shape: the shape of this rank's part as the rule steps it, when that is
            not the DTensor's local tensor: under FSDP2 over tensor parallelism,
            ``sharded`` mode's owner steps the tensor-parallel shard that its all-to-all
            over ``dp`` gathered (``None``: the local tensor's shape).
        gather: ``gather(shards)``: the whole matrices of a batch ``(B, ...)`` from every
            rank's shards (an all-gather over the group along :attr:`dim`), for the
            gather path of :meth:`StepContext.orthogonalize
            <dmuon.optim.transforms.StepContext.orthogonalize>`; ``None``: the Gram path
            only.
        offset: where this rank's shard starts along :attr:`dim` of the whole matrix.
        world_size: ranks in the group.

    Examples:
        >>> whole = MatrixSplit(-1, (64, 256), lambda t, op: t, ("tp", (0,)))
        >>> whole.key
        (-1, (64, 256), ('tp', (0,)))
    """

    dim: int
    shape: tuple[int, int]
    reduce: Callable[[torch.Tensor, str], torch.Tensor | None]
    group: Hashable
    local_shape: tuple[int, int] | None = None
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    offset: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.dim not in (-1, -2):
            raise ValueError(f"MatrixSplit.dim must be -2 (rows) or -1 (columns), got {self.dim}")

    @property
    def key(self) -> tuple[int, tuple[int, int], Hashable]:
        """What two matrices must share to be stepped in one batch."""
        return (self.dim, self.shape, self.group)

    @property
    def elements(self) -> int:
        """Entries of the whole matrix (batches are cut by it, the same on every rank)."""
        return self.shape[0] * self.shape[1]


PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The types of a plain (not distributed) tensor, tested with ``type(t) in ...``: the
common case, answered without importing DTensor or an ``isinstance`` (``is_dtensor``);
also the tensor types torch's foreach kernels take (torch.optim's own test, before
DTensor adds itself to it)."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (a view that writes through), or
    ``t`` itself.

    Examples:
        >>> import torch
        >>> t = torch.ones(2, 3)
        >>> local_tensor(t) is t
        True
    """
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
