"""The last step of every matrix rule: decoupled weight decay, then the scaled update.

Plain decoupled decay (Loshchilov & Hutter, arXiv 1711.05101) shrinks every entry:

    W ← W·(1 − lr·wd) − lr·s·U

Cautious weight decay (Chen et al., *Cautious Weight Decay*, arXiv 2510.12402) decays
only the entries where the update and the weight agree in sign — where decay and
update both pull the entry towards zero — and leaves the others to the update:

    W ← W − lr·wd·𝟙[U⊙W ≥ 0]⊙W − lr·s·U

(``s > 0``, so the sign of ``s·U`` is the sign of ``U``; the mask reads ``W`` before
the step.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_update", "decoupled_decay_"]


@torch.no_grad()
def apply_update(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    scale: float,
    cautious: bool = False,
) -> None:
    """``W ← W·(1 − lr·wd) − lr·scale·U`` for every pair, in two ``torch._foreach_*`` calls.

    With ``cautious``, the decay applies only where ``U⊙W ≥ 0`` (see the module
    docstring): ``W ← W − lr·wd·𝟙[U⊙W ≥ 0]⊙W − lr·scale·U``.

    The weight decay uses the *base* learning rate ``lr`` — not ``lr·scale`` — as in
    Moonlight and ``torch.optim.Muon`` (decoupled weight decay, Loshchilov & Hutter,
    arXiv 1711.05101), so it does not depend on the shape convention.

    Args:
        params: the weights (or views of them), updated in place.
        updates: the rule's output, each of the shape of its weight.
        lr: the group's learning rate.
        weight_decay: the group's weight decay.
        scale: the rule's scale (``adjust_lr`` factor and the like), > 0.
        cautious: cautious weight decay (the group's ``cautious_weight_decay``).

    Examples:
        >>> import torch
        >>> W = [torch.ones(2, 2)]
        >>> apply_update(W, [torch.ones(2, 2)], lr=0.1, weight_decay=0.5, scale=2.0)
        >>> W[0].flatten()[0].item()  # 1·(1 − 0.05) − 0.1·2·1
        0.75
        >>> W = [torch.tensor([1.0, 1.0])]  # the update agrees with the first entry only
        >>> apply_update(W, [torch.tensor([1.0, -1.0])], lr=0.1, weight_decay=0.5, scale=2.0,
        ...              cautious=True)
        >>> [round(w, 4) for w in W[0].tolist()]  # 1 − 0.05 − 0.2, 1 + 0.2
        [0.75, 1.2]
    """
    if not params:
        return
    params, updates = list(params), list(updates)
    decoupled_decay_(params, updates, lr=lr, weight_decay=weight_decay, cautious=cautious)
    torch._foreach_add_(params, updates, alpha=-lr * scale)


@torch.no_grad()
def decoupled_decay_(
    params: Sequence[torch.Tensor],
    directions: Sequence[torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    cautious: bool = False,
) -> None:
    """The decay of every optimizer here: ``W ← W·(1 − lr·wd)``, or with ``cautious``
    ``W ← W − lr·wd·𝟙[D⊙W ≥ 0]⊙W`` (see the module docstring).

    ``directions`` (read with ``cautious`` only): a tensor per weight with the sign of
    its update — the matrix rule's ``U``, AdamW's new first moment, Lion's sign.

    Examples:
        >>> import torch
        >>> W = [torch.tensor([2.0, -1.0, 0.0])]
        >>> decoupled_decay_(W, [torch.tensor([3.0, 1.0, -5.0])], lr=0.5, weight_decay=0.5,
        ...                  cautious=True)
        >>> W[0].tolist()  # the second entry's update disagrees with it: not decayed
        [1.5, -1.0, 0.0]
    """
    if weight_decay == 0.0 or lr == 0.0:
        return
    params = list(params)
    if not cautious:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        return
    products = torch._foreach_mul(list(directions), params)
    decayed = [(u >= 0).to(w.dtype) for u, w in zip(products, params, strict=True)]
    torch._foreach_mul_(decayed, params)  # 𝟙[D⊙W ≥ 0]⊙W
    torch._foreach_add_(params, decayed, alpha=-lr * weight_decay)
