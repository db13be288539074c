"""The options every Newton–Schulz entry point takes, their defaults and their checks.

:func:`~dmuon.kernels.orthogonalize`, :func:`~dmuon.kernels.gram_newton_schulz` and
:func:`~dmuon.kernels.newton_schulz` take the same keyword arguments (the standard
iteration has no ``restarts``). They keep them as plain keywords in their public
signatures, take the defaults from :data:`DEFAULTS` and hand them on as one
:class:`NSOptions`, so a default or a check is written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dmuon.kernels.coefficients import Schedule, resolve_coefficients

__all__ = ["DEFAULTS", "NSOptions", "check_restarts"]


@dataclass(frozen=True)
class NSOptions:
    """The keyword arguments of one Newton–Schulz call (see :func:`~dmuon.kernels.orthogonalize`).

    Attributes:
        coefficients: coefficient-set name or explicit ``(a, b, c)`` triples.
        steps: number of Newton–Schulz steps.
        restarts: Gram restarts (ignored by the standard iteration).
        eps: relative guard of the normalisation.
        compute_dtype: dtype of the matmuls; ``None``: per device and method.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        cuda_graph: ``None`` (the process default), ``True`` or ``False``.

    Examples:
        >>> from dmuon.kernels.ns_options import DEFAULTS
        >>> DEFAULTS.coefficients, DEFAULTS.steps, DEFAULTS.restarts
        ('polar_express', 5, (2,))
        >>> len(DEFAULTS.resolve("gram")[0])  # five (a, b, c) triples
        5
    """

    coefficients: str | Sequence[Sequence[float]] = "polar_express"
    steps: int = 5
    restarts: Sequence[int] = (2,)
    eps: float = 1e-7
    compute_dtype: torch.dtype | None = None
    backend: str = "auto"
    cuda_graph: bool | None = None

    def resolve(self, method: str) -> tuple[Schedule, tuple[int, ...]]:
        """The checked schedule and restarts (``()`` for the standard iteration).

        Raises:
            ValueError: ``coefficients``, ``steps`` or (for ``"gram"``) ``restarts``
                are invalid.
        """
        schedule = resolve_coefficients(self.coefficients, self.steps)
        restarts = check_restarts(self.restarts, self.steps) if method == "gram" else ()
        return schedule, restarts


DEFAULTS = NSOptions()
"""The defaults of every entry point's keyword arguments."""


def check_restarts(restarts: Sequence[int], steps: int) -> tuple[int, ...]:
    """Validate restart iterations: integers in ``[1, steps)``, returned sorted and unique."""
    out = set()
    for r in restarts:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r < steps:
            raise ValueError(
                f"restarts must be iteration indices in [1, {steps}) for steps={steps}, "
                f"got {tuple(restarts)!r}"
            )
        out.add(r)
    return tuple(sorted(out))
