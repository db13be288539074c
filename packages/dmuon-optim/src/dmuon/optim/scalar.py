"""The scalar-parameter optimizers: AdamW and Lion, over lists with ``torch._foreach_*``.

Embeddings, output heads, norms, biases and scalars are not matrices in Muon's
sense; they take an elementwise optimizer in the same ``DMuon`` object.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.adamw import adamw as _torch_adamw

__all__ = ["SCALAR_ALGORITHMS", "adamw_step", "lion_step", "scalar_state_shapes"]

SCALAR_ALGORITHMS = ("adamw", "lion")
"""The ``algorithm`` values a scalar group (embeddings, head, norms, biases) may take:
AdamW (decoupled weight decay, Loshchilov & Hutter 2019) or Lion (Chen et al. 2023)."""


def scalar_state_shapes(algorithm: str, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """The state keys of one parameter under ``algorithm`` and their shapes."""
    shape = tuple(param.shape)
    if algorithm == "adamw":
        return {"step": (), "exp_avg": shape, "exp_avg_sq": shape}
    return {"step": (), "exp_avg": shape}


def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step (Loshchilov & Hutter, arXiv 1711.05101) with torch's own functional.

    ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²``,
    ``W ← W(1 − lr·wd) − lr·m̂/(√v̂ + ε)`` with bias-corrected ``m̂``, ``v̂``:
    exactly :class:`torch.optim.AdamW` (same code path, foreach where torch picks it).

    Examples:
        >>> import torch
        >>> p, g = torch.ones(3), torch.ones(3)
        >>> m, v, t = torch.zeros(3), torch.zeros(3), torch.zeros(())
        >>> adamw_step([p], [g], [m], [v], [t], lr=0.1, betas=(0.9, 0.95), eps=1e-8,
        ...            weight_decay=0.0)
        >>> round(p[0].item(), 4)
        0.9
    """
    _torch_adamw(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        list(steps),
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )


def lion_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """One Lion step (Chen et al., *Symbolic Discovery of Optimization Algorithms*, 2023).

    ``c = β₁m + (1−β₁)g``, ``W ← W(1 − lr·wd) − lr·sign(c)``, ``m ← β₂m + (1−β₂)g``.
    Source: arXiv 2302.06675. Lion's updates have RMS 1, so its learning rate is
    typically 3–10× smaller than AdamW's.

    Examples:
        >>> import torch
        >>> p, g, m, t = torch.zeros(2), torch.tensor([1.0, -2.0]), torch.zeros(2), torch.zeros(())
        >>> lion_step([p], [g], [m], [t], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
        >>> tuple(round(x, 6) for x in p.tolist())
        (-0.1, 0.1)
    """
    params, grads, exp_avgs = list(params), list(grads), list(exp_avgs)
    if not params:
        return
    beta1, beta2 = betas
    directions = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(directions)
    if weight_decay != 0.0 and lr != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, directions, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
    torch._foreach_add_(list(steps), 1.0)
