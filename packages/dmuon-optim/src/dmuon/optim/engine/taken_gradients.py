"""The gradients a reduction copied into its buckets, as they were when it took them.

Owner mode reduces each gradient to its owner while backward goes on: the bucket holds a
copy made at the launch. A gradient changed after that (``p.grad.mul_(...)``, torch's
``clip_grad_norm_``, a new tensor put in ``p.grad``) would not reach the owner, which
steps the copy. :class:`TakenGradients` records each gradient taken — the tensor and its
version counter(s) — so that the step's agreement can refuse such a change on every rank
(:class:`~dmuon.optim.GradientChangedError`; :mod:`~dmuon.optim.engine.guards`). The
dense layers' reduction (:class:`~dmuon.optim.engine.reduction.Reduction`) and the expert
stacks' (:class:`~dmuon.optim.engine.expert_replicas.ExpertReplicas`) keep one each.
A write that counts on no version counter it reads goes unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

__all__ = ["TakenGradients", "own_version"]


def own_version(g: torch.Tensor) -> int:
    """The version counter of the tensor ``g`` itself (a DTensor's own: writes through its
    local tensor are not counted)."""
    return g._version


class TakenGradients:
    """Each gradient copied into a bucket this step, by key, as it was then.

    Args:
        versions: what is compared of a gradient (default :func:`own_version`).

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> p.grad = torch.ones(2)
        >>> taken = TakenGradients()
        >>> taken.take("w", "w", p)
        >>> p.grad.mul_(2)  # after the copy: the owner would not see it
        tensor([2., 2.])
        >>> taken.changed()
        ['w']
    """

    def __init__(self, versions: Callable[[torch.Tensor], Any] = own_version) -> None:
        self._versions = versions
        # key → (name, parameter, the gradient taken, its versions)
        self._taken: dict[Hashable, tuple[str, torch.Tensor, torch.Tensor, Any]] = {}
        self._changed: list[str] = []

    def take(self, key: Hashable, name: str, param: torch.Tensor) -> None:
        """``param``'s gradient (if any) was copied into its bucket now."""
        g = param.grad
        if g is not None:
            self._taken[key] = (name, param, g, self._versions(g))

    def _is_changed(self, key: Hashable) -> bool:
        _, param, g, versions = self._taken[key]
        return param.grad is not g or self._versions(g) != versions

    def settle(self, keys: Iterable[Hashable]) -> None:
        """Before the gradients of ``keys`` are replaced by the reduced ones: remember which
        were changed since they were taken, and forget them."""
        for key in keys:
            if key in self._taken:
                if self._is_changed(key):
                    self._changed.append(self._taken[key][0])
                del self._taken[key]

    def changed(self) -> list[str]:
        """The names of the gradients changed since they were taken this step."""
        return [*self._changed, *(t[0] for k, t in self._taken.items() if self._is_changed(k))]

    def clear(self) -> None:
        """Forget this step's record (after the step's agreement)."""
        self._taken.clear()
        self._changed.clear()
