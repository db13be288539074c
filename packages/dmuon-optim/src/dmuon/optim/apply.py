"""The last step of every matrix rule: decoupled weight decay, then the scaled update."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_update"]


@torch.no_grad()
def apply_update(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    scale: float,
) -> None:
    """``W ← W·(1 − lr·wd) − lr·scale·U`` for every pair, in two ``torch._foreach_*`` calls.

    The weight decay uses the *base* learning rate ``lr`` — not ``lr·scale`` — as in
    Moonlight and ``torch.optim.Muon`` (decoupled weight decay, Loshchilov & Hutter,
    arXiv 1711.05101), so it does not depend on the shape convention.

    Args:
        params: the weights (or views of them), updated in place.
        updates: the rule's output, each of the shape of its weight.
        lr: the group's learning rate.
        weight_decay: the group's weight decay.
        scale: the rule's scale (``adjust_lr`` factor and the like).

    Examples:
        >>> import torch
        >>> W = [torch.ones(2, 2)]
        >>> apply_update(W, [torch.ones(2, 2)], lr=0.1, weight_decay=0.5, scale=2.0)
        >>> W[0].flatten()[0].item()  # 1·(1 − 0.05) − 0.1·2·1
        0.75
    """
    if not params:
        return
    if weight_decay != 0.0 and lr != 0.0:
        torch._foreach_mul_(list(params), 1.0 - lr * weight_decay)
    torch._foreach_add_(list(params), list(updates), alpha=-lr * scale)
