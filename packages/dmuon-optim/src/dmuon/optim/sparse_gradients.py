"""Sparse gradients are refused: DMuon's buckets stack dense gradients and its rules
read them (``nn.Embedding(sparse=True)`` gives one).

:func:`first_sparse` is the one place that looks for them; each way into a step names
what it finds with :func:`sparse_gradient_error`. ``DMuon.step`` looks once, in
:meth:`~dmuon.optim.group_record.GroupRecord.check`, before anything is stepped; with
other ranks it carries what it found in the step's agreement
(:func:`~dmuon.optim.engine.guards.agree_step`), so a sparse gradient on one rank is
refused on every rank at once rather than leaving the others waiting for it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["SparseGradientError", "first_sparse", "sparse_gradient_error"]


class SparseGradientError(RuntimeError):
    """A gradient is sparse (on this rank, or on another rank of the step's agreement).

    Examples:
        >>> isinstance(sparse_gradient_error("parameter 'w'"), RuntimeError)
        True
    """


def sparse_gradient_error(name: str) -> SparseGradientError:
    """The error for a sparse gradient of ``name`` (a parameter, as errors name one)."""
    return SparseGradientError(
        f"DMuon does not support sparse gradients: {name} has one (e.g. "
        "nn.Embedding(sparse=True)); use dense gradients"
    )


def first_sparse(grads: Iterable[torch.Tensor | None]) -> int | None:
    """The position of the first sparse tensor of ``grads`` (``None`` entries skipped), or
    ``None`` when there is none: one pass, an attribute read per gradient.

    Examples:
        >>> first_sparse([None, torch.ones(2), torch.ones(2).to_sparse()])
        2
        >>> first_sparse([torch.ones(2)]) is None
        True
    """
    for i, g in enumerate(grads):
        if g is not None and g.is_sparse:
            return i
    return None
