"""Learning-rate conventions: how the size of an orthogonalised update depends on its shape.

An ``m × n`` semi-orthogonal matrix ``O`` (all singular values 1) has spectral norm 1
and RMS ``1/√max(m, n)``. Each convention multiplies ``O`` by a factor of its shape
(``m`` = rows = fan-out, ``n`` = columns = fan-in) before the learning rate:

* ``"original"``: ``√max(1, m/n)``; update RMS ``1/√n``. K. Jordan, *Muon* (2024),
  the default of ``torch.optim.Muon``.
* ``"match_rms_adamw"``: ``0.2·√max(m, n)``; update RMS 0.2 for every shape.
  Moonlight (Liu et al., arXiv 2502.16982), eq. 4.
* ``"spectral"``: ``√(m/n)``; spectral norm ``√(fan_out/fan_in)``. Yang, Simon,
  Bernstein, arXiv 2310.17813; the default of microsoft/dion.
* ``None``: ``1``; the plain polar step, RMS ``1/√max(m, n)``.

With ``"match_rms_adamw"`` the update of every matrix has the RMS (0.2) of a
typical AdamW update, so the learning rate and weight decay tuned for AdamW
transfer; that is why it is DMuon's default.
"""

from __future__ import annotations

import math

__all__ = ["ADJUST_LR", "adjust_lr_factor"]

ADJUST_LR: tuple[str | None, ...] = ("original", "match_rms_adamw", "spectral", None)
"""The learning-rate conventions of ``adjust_lr=`` for an ``m × n`` update: ``"original"``
√max(1, m/n) (Keller Jordan's Muon), ``"match_rms_adamw"`` 0.2·√max(m, n) (Moonlight,
the default: AdamW-like learning rates), ``"spectral"`` √(m/n), ``None`` (factor 1)."""


def adjust_lr_factor(adjust_lr: str | None, m: int, n: int) -> float:
    """The factor the convention ``adjust_lr`` puts on an orthogonal ``m × n`` update.

    Args:
        adjust_lr: one of ``"original"``, ``"match_rms_adamw"``, ``"spectral"``, ``None``.
        m: rows of the matrix that was orthogonalised (fan-out).
        n: columns (fan-in).

    Raises:
        ValueError: unknown convention or a non-positive dimension.

    Examples:
        >>> adjust_lr_factor("match_rms_adamw", 768, 3072)
        11.08...
        >>> adjust_lr_factor("original", 3072, 768)
        2.0
    """
    if m <= 0 or n <= 0:
        raise ValueError(f"matrix dimensions must be positive, got {m} x {n}")
    if adjust_lr == "original":
        return math.sqrt(max(1.0, m / n))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "spectral":
        return math.sqrt(m / n)
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"adjust_lr must be one of {list(ADJUST_LR)}, got {adjust_lr!r}")
