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

__all__ = ["DEFAULTS", "NSOptions", "check_restarts", "default_restarts"]


@dataclass(frozen=True)
class NSOptions:
    """The keyword arguments of one Newton–Schulz call (see :func:`~dmuon.kernels.orthogonalize`).

    Attributes:
        coefficients: coefficient-set name or explicit ``(a, b, c)`` triples.
        steps: number of Newton–Schulz steps.
        restarts: Gram restarts (ignored by the standard iteration). The default,
            ``None``, is one restart chosen per compute dtype
            (:func:`default_restarts`). An explicit ``(2,)`` on a 1- or 2-step
            schedule, which has no iteration to restart at, runs without (as the
            earlier default ``(2,)`` did).
        eps: relative guard of the normalisation.
        compute_dtype: dtype of the matmuls; ``None``: per device and method.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        cuda_graph: ``None`` (the process default), ``True`` or ``False``.

    Examples:
        >>> from dmuon.kernels.ns_options import DEFAULTS
        >>> DEFAULTS.coefficients, DEFAULTS.steps, DEFAULTS.restarts
        ('polar_express', 5, None)
        >>> len(DEFAULTS.resolve("gram")[0])  # five (a, b, c) triples
        5
    """

    coefficients: str | Sequence[Sequence[float]] = "polar_express"
    steps: int = 5
    restarts: Sequence[int] | None = None
    eps: float = 1e-7
    compute_dtype: torch.dtype | None = None
    backend: str = "auto"
    cuda_graph: bool | None = None

    def resolve(self, method: str) -> tuple[Schedule, tuple[int, ...] | None]:
        """The checked schedule and restarts (``()`` for the standard iteration; ``None``
        for the default, which :func:`default_restarts` resolves once the compute dtype
        is known).

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
        if restarts is None:
            return schedule, None
        if isinstance(restarts, Sequence) and tuple(restarts) == (2,) and self.steps <= 2:
            restarts = ()  # the earlier default restart lies past a 1- or 2-step schedule
        return schedule, check_restarts(restarts, self.steps)


MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes ``compute_dtype`` may name (fp8 has no batched matmul in torch)."""

DEFAULTS = NSOptions()
"""The defaults of every entry point's keyword arguments."""


def default_restarts(steps: int, compute_dtype: torch.dtype) -> tuple[int, ...]:
    """The Gram restarts used when none are given: one, at iteration 2, or at 3 in bf16.

    Iteration 2 is the restart the Gram Newton–Schulz paper uses for five-step
    schedules (fp16). In bf16, whose 8-bit mantissa lets the evolved ``R`` drift more,
    a restart at 2 lets the top singular value of a wide matrix reach 1.17–1.38 on
    spectra spread over decades (256 × 1024, Polar Express, five steps), where a
    restart at 3 keeps it at 1.13, the same as fp16: same number of products, same
    cost (``benchmarks/ns_restarts.py`` measures both). A schedule too short for the
    restart runs without (3 steps in bf16 restart at 2; 1 or 2 steps, none).

    Examples:
        >>> import torch
        >>> default_restarts(5, torch.float16), default_restarts(5, torch.bfloat16)
        ((2,), (3,))
        >>> default_restarts(3, torch.bfloat16), default_restarts(2, torch.float32)
        ((2,), ())
    """
    at = 3 if compute_dtype == torch.bfloat16 and steps > 3 else 2
    return (at,) if steps > at else ()


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
