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

A gradient that is a view of a larger tensor (``p.grad`` preallocated as views of one
flat buffer, as apex and Megatron do) shares its base's version counter with every other
view: a later layer's accumulation moves it too, though this gradient did not change.
For such a gradient :meth:`TakenGradients.take` also keeps a checksum of its values (its
fp32 sum and 2-norm), and a moved counter counts as a change only when the checksum moved
too: torch's ``clip_grad_norm_`` scaling it, ``mul_``, ``neg_`` are still found, a write
that keeps both the sum and the norm (a permutation of the entries) is not.

The other way round, :class:`KeptGradients` records the averaged gradient a step leaves
on each owner (``p.grad``, a view of the bucket; the other ranks hold none): a backward
that adds to it without a ``zero_grad()`` between (or a second ``step()`` without a
backward) would send it to the owner again as if it were the owner's own gradient, and
the owner would step with ``avg₁/N + avg₂`` where one process steps with ``avg₁ + avg₂``.
The step's agreement refuses it on every rank (:class:`~dmuon.optim.StaleGradientError`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container, Hashable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["KeptGradients", "TakenGradients", "own_version"]


def own_version(g: torch.Tensor) -> int:
    """The version counter of the tensor ``g`` itself (a DTensor's own: writes through its
    local tensor are not counted)."""
    return g._version


def shares_version(g: torch.Tensor) -> bool:
    """Whether ``g`` is a plain view of another tensor, so that its version counter moves
    with writes to any view of the same base (not only to ``g``)."""
    return type(g) is torch.Tensor and g._base is not None


def checksum(g: torch.Tensor) -> torch.Tensor:
    """``g``'s fp32 sum and 2-norm (a float32 tensor of 2): what :class:`TakenGradients`
    compares of a gradient whose version counter it shares with other views."""
    return torch.stack([g.sum(dtype=torch.float32), g.norm(dtype=torch.float32)])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two checksums are equal, NaN matching NaN (a NaN gradient stays NaN; the
    step's non-finite check is the one that finds it)."""
    return bool(torch.all((a == b) | (a.isnan() & b.isnan())))


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
        # key → (name, parameter, the gradient taken, its versions, and its checksum when
        # its version counter is shared with other views, shares_version)
        self._taken: dict[
            Hashable, tuple[str, torch.Tensor, torch.Tensor, Any, torch.Tensor | None]
        ] = {}
        self._changed: list[str] = []

    def take(self, key: Hashable, name: str, param: torch.Tensor) -> None:
        """``param``'s gradient (if any) was copied into its bucket now."""
        g = param.grad
        if g is not None:
            summed = checksum(g) if shares_version(g) else None
            self._taken[key] = (name, param, g, self._versions(g), summed)

    def _is_changed(self, key: Hashable) -> bool:
        _, param, g, versions, summed = self._taken[key]
        if param.grad is not g:
            return True
        if self._versions(g) == versions:
            return False
        # a view's counter moves with its siblings' writes: its values tell
        return summed is None or not _same(checksum(g), summed)

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


class KeptGradients:
    """The reduced gradients a step left on this rank (the owner's), to find them stale.

    :meth:`leave` records, after a step, each gradient the reduction set: views of the
    reduction's buffers, which share one version counter per buffer. :meth:`check`,
    before the next step's launch of a parameter, takes every kept gradient of its buffer
    that is still ``p.grad`` and finds them *stale* when the buffer's version moved by
    exactly the number of them this step's backward reached: nothing but the backward's
    accumulation into them (``+1`` each) touched them, so no ``zero_grad`` ran between
    (in place, it moves each by one more; to ``None``, ``p.grad`` is another tensor). A
    buffer nothing touched (moved by 0, no gradient arrived) is a second ``step()``
    without a backward. Anything else — a write it cannot attribute — is let through.

    Examples:
        >>> import torch
        >>> buffer = torch.zeros(4)
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> p.grad = buffer[:2]  # the reduced gradient the step used, a view
        >>> kept = KeptGradients()
        >>> kept.leave({"w": p.grad})
        >>> p.grad.add_(1)  # the next backward, without zero_grad()
        tensor([1., 1.])
        >>> kept.check("w", {"w": p}, arrived={"w"}), kept.stale()
        (True, ['w'])
    """

    def __init__(self) -> None:
        # each buffer's kept gradients (name → the gradient left) and its version then,
        # by buffer; and the buffer of each name
        self._buffers: dict[int, tuple[int, dict[str, weakref.ref[torch.Tensor]]]] = {}
        self._buffer_of: dict[str, int] = {}
        self._stale: list[str] = []

    def leave(self, grads: Mapping[str, torch.Tensor]) -> None:
        """After a step: ``grads`` (name → the reduced gradient set) stay on this rank."""
        self._buffers, self._buffer_of = {}, {}
        for name, g in grads.items():
            key = id(g._base if g._base is not None else g)
            # the version is shared with every view of the buffer
            self._buffers.setdefault(key, (own_version(g), {}))[1][name] = weakref.ref(g)
            self._buffer_of[name] = key

    def check(self, name: str, params: Mapping[str, torch.Tensor], arrived: Container[str]) -> bool:
        """Whether the gradients the last step left in ``name``'s buffer are stale (see
        above; ``arrived``: the names this step's backward reached); recorded for
        :meth:`stale`. The buffer's kept gradients are forgotten either way."""
        key = self._buffer_of.get(name)
        if key is None:
            return False
        version, kept = self._buffers.pop(key)
        for n in kept:
            del self._buffer_of[n]
        live = [n for n, ref in kept.items() if (g := params[n].grad) is not None and ref() is g]
        if not live:
            return False
        moved = own_version(params[live[0]].grad) - version  # type: ignore[arg-type]
        if moved != sum(n in arrived for n in live):
            return False
        self._stale += live
        return name in live

    def pending(self) -> list[str]:
        """The names still to :meth:`check` this step."""
        return list(self._buffer_of)

    def stale(self) -> list[str]:
        """The parameters found stale this step (emptied by :meth:`clear`)."""
        return list(self._stale)

    def clear(self) -> None:
        """Forget what was found this step (the record of what the step left stays)."""
        self._stale.clear()
