"""FLOP counts of what the Newton–Schulz implementations run.

Counted: every matrix product, as ``2·p·q·r`` for ``(p×q)(q×r)``, exactly as the
torch path issues them (symmetric products are counted in full; the Triton
symmetric kernels do about half of that work, which shows up as a higher
achieved rate, not a different count). Not counted: elementwise scaling and
additions fused into ``baddbmm``, the normalisation and the casts, all
``O(mn)`` per matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ns_flops"]


def ns_flops(
    m: int,
    n: int,
    *,
    method: str = "gram",
    steps: int = 5,
    restarts: Sequence[int] = (2,),
    batch: int = 1,
) -> int:
    """Matrix-product FLOPs of one :func:`~dmuon.kernels.orthogonalize` call.

    With ``s = min(m, n)``, ``l = max(m, n)`` (the implementation works on the wide
    ``s × l`` orientation):

    * standard: per step ``X Xᵀ`` (2s²l), ``A·A`` (2s³), ``B·X`` (2s²l), so
      ``steps · (4s²l + 2s³)``;
    * gram: ``R = X Xᵀ`` (2s²l) once; per step ``R·R`` (2s³), ``Q·Z`` (2s³, except the
      first step of a window), and if ``R`` is evolved for the next step ``R·Z`` and
      ``Z·RZ`` (4s³); at a restart ``Q·X`` and ``X Xᵀ`` (4s²l); at the end ``Q·X``
      (2s²l). Five steps with a restart at 2: ``8s²l + 28s³``. Square matrices run
      the standard iteration.

    Raises:
        ValueError: unknown ``method`` or a negative size, step count or batch.

    Examples:
        >>> ns_flops(768, 3072, method="standard")  # 5·(4·768²·3072 + 2·768³)
        40768634880
    """
    if method not in ("gram", "standard"):
        raise ValueError(f"method must be 'gram' or 'standard', got {method!r}")
    if min(m, n, steps, batch) < 0:
        raise ValueError(
            f"m, n, steps and batch must be ≥ 0, got m={m}, n={n}, steps={steps}, batch={batch}"
        )
    s, l = min(m, n), max(m, n)
    if s == 0 or steps == 0 or batch == 0:
        return 0
    if method == "standard" or s == l:
        return batch * steps * (4 * s * s * l + 2 * s**3)
    restart_set = set(restarts)
    flops = 2 * s * s * l  # R = X Xᵀ
    first_of_window = True
    for i in range(steps):
        if i in restart_set and not first_of_window:
            flops += 4 * s * s * l  # X ← Q X, R ← X Xᵀ
            first_of_window = True
        flops += 2 * s**3  # R·R inside Z = bR + cR²
        if not first_of_window:
            flops += 2 * s**3  # Q·Z
        first_of_window = False
        if i < steps - 1 and (i + 1) not in restart_set:
            flops += 4 * s**3  # R·Z and Z·RZ
    flops += 2 * s * s * l  # X ← Q X
    return batch * flops
