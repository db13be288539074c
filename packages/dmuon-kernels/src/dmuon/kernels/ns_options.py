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
        restarts: Gram restarts (ignored by the standard iteration). The default,
            ``(2,)``, applies to schedules of more than 2 steps; 1 or 2 steps have no
            iteration to restart at, and run without.
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
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
            raise ValueError(f"eps must be a number > 0, got {self.eps!r}")
        if not 0 < self.eps < float("inf"):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps!r}")
        dtype = self.compute_dtype
        if dtype is not None and dtype not in MATMUL_DTYPES:
            raise ValueError(
                "compute_dtype must be None (per device and method) or one of "
                f"{', '.join(map(str, MATMUL_DTYPES))} (the dtypes torch multiplies "
                f"matrices in), got {dtype!r}"
            )
        if method != "gram":
            return schedule, ()
        restarts = self.restarts
        if (
            isinstance(restarts, Sequence)
            and tuple(restarts) == tuple(DEFAULTS.restarts)
            and self.steps <= max(DEFAULTS.restarts)
        ):
            restarts = ()  # the default restart lies past a 1- or 2-step schedule
        return schedule, check_restarts(restarts, self.steps)


MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes ``compute_dtype`` may name (fp8 has no batched matmul in torch)."""

DEFAULTS = NSOptions()
"""The defaults of every entry point's keyword arguments."""


def check_restarts(restarts: Sequence[int], steps: int) -> tuple[int, ...]:
    """Validate restart iterations: integers in ``[1, steps)``, returned sorted and unique."""
    if isinstance(restarts, (str, bytes)) or not isinstance(restarts, Sequence):
        raise ValueError(
            f"restarts must be a sequence of iteration indices in [1, {steps}), e.g. (2,) or "
            f"(), got {restarts!r}"
        )
    out = set()
    for r in restarts:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r < steps:
            raise ValueError(
                f"restarts must be iteration indices in [1, {steps}) for steps={steps}, "
                f"got {tuple(restarts)!r}"
            )
        out.add(r)
    return tuple(sorted(out))
