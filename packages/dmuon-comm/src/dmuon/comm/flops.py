"""Newton–Schulz FLOP counts, the compute term of the default owner cost.

``dmuon.comm`` must not import ``dmuon.kernels`` (the two packages sit side by side
in the layering), so the count is restated here in closed form. It mirrors
:func:`dmuon.kernels.ns_flops` exactly; ``tests-integration`` checks the two
against each other over many shapes, step counts and restart sets.
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
    """Matrix-product FLOPs of orthogonalising ``batch`` matrices of shape ``m × n``.

    With ``s = min(m, n)`` and ``l = max(m, n)`` (the wide orientation):

    * ``"standard"`` Newton–Schulz, per step ``X Xᵀ``, ``A·A`` and ``B·X``:
      ``steps · (4s²l + 2s³)``;
    * ``"gram"`` Newton–Schulz with ``t`` restarts inside ``[1, steps)``:
      ``4(1 + t)·s²l + (8·steps − 6 − 6t)·s³`` — the ``s × l`` products are the
      first Gram matrix, one ``Q X`` plus one ``X Xᵀ`` per restart and the final
      ``Q X``; the rest happens on ``s × s`` matrices. Five steps with a restart at
      2 give ``8s²l + 28s³``. A square matrix runs the standard iteration (the
      Gram form saves nothing there).

    This is the count of :func:`dmuon.kernels.ns_flops` (Zhang, Amsel, Chen, Dao,
    *Gram Newton–Schulz*, 2026, for the Gram iteration), restated in closed form.

    Args:
        m: rows.
        n: columns.
        method: ``"gram"`` or ``"standard"``.
        steps: Newton–Schulz steps.
        restarts: Gram restart iterations; entries outside ``[1, steps)`` have no
            effect.
        batch: number of matrices.

    Raises:
        ValueError: unknown ``method`` or a negative size.

    Examples:
        >>> ns_flops(768, 3072, method="standard")  # 5·(4·768²·3072 + 2·768³)
        40768634880
        >>> s, l = 1024, 4096
        >>> ns_flops(s, l) == 8 * s * s * l + 28 * s**3
        True
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
    t = len({r for r in restarts if 1 <= r < steps})
    return batch * (4 * (1 + t) * s * s * l + (8 * steps - 6 - 6 * t) * s**3)
