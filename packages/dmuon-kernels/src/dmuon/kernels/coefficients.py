"""Named coefficient schedules for the quintic Newton–Schulz iteration.

One Newton–Schulz step maps ``X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X``. On the singular
values of ``X`` this is the odd scalar polynomial ``p(σ) = aσ + bσ³ + cσ⁵``, so
a schedule of ``(a, b, c)`` triples is fully described by what its composition
does to σ ∈ (0, 1] (the input is first normalised so that σ_max ≤ 1).
:func:`ns_scalar_map` evaluates that composition; it is the reference against
which the matrix iterations are tested.

Every set is documented with its source and with the *band* its composition is
promised to land in: for singular values σ/‖G‖_F ≥ ``lower`` (after the
Frobenius normalisation), five iterations in exact arithmetic give outputs
in ``band``. Smaller singular values are not yet pushed up to the band; every
set maps all of ``(0, 1]`` into ``[0, 1.21]`` and is increasing near 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

Triple = tuple[float, float, float]
Schedule = tuple[Triple, ...]

__all__ = [
    "COEFFICIENT_SETS",
    "MAX_STEPS",
    "CoefficientSet",
    "get_coefficients",
    "ns_scalar_map",
    "resolve_coefficients",
]


@dataclass(frozen=True)
class CoefficientSet:
    """A named Newton–Schulz schedule.

    Attributes:
        name: key used by :func:`get_coefficients` and ``orthogonalize(coefficients=...)``.
        schedule: the published triples, in order. Steps beyond the schedule repeat
            its last triple (for Polar Express this is the converged polynomial the
            paper prescribes for every later step).
        source: paper or code the triples come from.
        lower: smallest normalised singular value the promise in ``band`` covers
            at the default of five steps.
        band: ``(lo, hi)`` interval the composed map sends ``[lower, 1]`` into
            with five steps in exact arithmetic.

    Examples:
        >>> from dmuon.kernels import COEFFICIENT_SETS
        >>> cset = COEFFICIENT_SETS["keller"]
        >>> cset.band, len(cset.triples(5))
        ((0.68, 1.14), 5)
    """

    name: str
    schedule: Schedule
    source: str
    lower: float
    band: tuple[float, float]

    def triples(self, steps: int) -> Schedule:
        """The first ``steps`` triples, repeating the last published one if needed."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if steps <= len(self.schedule):
            return self.schedule[:steps]
        return self.schedule + (self.schedule[-1],) * (steps - len(self.schedule))


def _with_safety(schedule: Schedule, s: float) -> Schedule:
    """Polar Express safety factor: ``a/s, b/s³, c/s⁵``.

    Dividing by ``s`` evaluates each polynomial at ``σ/s``, which keeps a value that
    rounding pushed slightly above the interval of a step from being mapped out of
    it (Amsel et al. 2025, §4).
    """
    return tuple((a / s, b / s**3, c / s**5) for a, b, c in schedule)


_KELLER: Schedule = ((3.4445, -4.7750, 2.0315),)

_YOU: Schedule = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Polar Express, l = 1e-3, cushion 0.02, no safety factor (Amsel, Persson, Musco,
# Gower, arXiv 2505.16932; NoahAmsel/PolarExpress). Steps past the eighth use the
# last triple, the minimax polynomial of the converged interval.
_POLAR_EXPRESS_RAW: Schedule = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

# The modded-nanogpt / microsoft/dion variant: five steps with a 2e-2 safety
# factor baked into all but the last step, designed for X/(1.02·‖X‖_F).
_POLAR_EXPRESS_NANOGPT: Schedule = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

COEFFICIENT_SETS: dict[str, CoefficientSet] = {
    s.name: s
    for s in (
        CoefficientSet(
            name="keller",
            schedule=_KELLER,
            source="K. Jordan, 'Muon: An optimizer for hidden layers' (2024); "
            "KellerJordan/Muon muon.py. Chosen to maximise the slope at 0; does not "
            "converge to 1 but lands in roughly [0.7, 1.15].",
            lower=1e-2,
            band=(0.68, 1.14),
        ),
        CoefficientSet(
            name="you",
            schedule=_YOU,
            source="J. You's five-step schedule (modded-nanogpt; "
            "Dao-AILab/gram-newton-schulz coefficients.py).",
            lower=1e-2,
            band=(0.97, 1.04),
        ),
        CoefficientSet(
            name="polar_express",
            schedule=_with_safety(_POLAR_EXPRESS_RAW, 1.05),
            source="Polar Express (Amsel et al., arXiv 2505.16932) with every triple "
            "divided by the safety factor s = 1.05 (a/s, b/s³, c/s⁵), the variant "
            "used by Gram Newton–Schulz (Dao-AILab) and the DMuon paper's release, "
            "robust to half-precision rounding.",
            lower=1e-3,
            band=(0.72, 1.13),
        ),
        CoefficientSet(
            name="polar_express_raw",
            schedule=_POLAR_EXPRESS_RAW,
            source="Polar Express (Amsel et al., arXiv 2505.16932), l = 1e-3, "
            "cushion 0.02, no safety factor (NoahAmsel/PolarExpress).",
            lower=1e-3,
            band=(0.87, 1.13),
        ),
        CoefficientSet(
            name="polar_express_nanogpt",
            schedule=_POLAR_EXPRESS_NANOGPT,
            source="Polar Express as used by modded-nanogpt and microsoft/dion: safety "
            "2e-2 baked into all but the last of five steps.",
            lower=1e-3,
            band=(0.85, 1.15),
        ),
    )
}
"""Every named schedule, by name: what ``coefficients="..."`` accepts."""


def get_coefficients(name: str, steps: int = 5) -> Schedule:
    """Return ``steps`` ``(a, b, c)`` triples of the named schedule.

    Args:
        name: one of ``"keller"``, ``"you"``, ``"polar_express"``,
            ``"polar_express_raw"``, ``"polar_express_nanogpt"``
            (see :data:`COEFFICIENT_SETS` for sources and bands).
        steps: number of Newton–Schulz steps, 1 to :data:`MAX_STEPS`; schedules shorter
            than ``steps`` repeat their last triple.

    Examples:
        >>> get_coefficients("keller", 2)
        ((3.4445, -4.775, 2.0315), (3.4445, -4.775, 2.0315))
    """
    try:
        cset = COEFFICIENT_SETS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown coefficient set {name!r}; expected one of {sorted(COEFFICIENT_SETS)}"
        ) from None
    _check_steps(steps)
    return cset.triples(steps)


MAX_STEPS = 100
"""The most Newton–Schulz steps a call may ask for (DMuon's ``ns_steps`` has the same
bound). The tuned quintic sets converge in about 5 steps and the classical cubic
``(1.5, -0.5, 0)`` from a singular value of 1e-7 in about 40; more is never meant, and
``steps=10**9`` built a schedule of that many triples (``MemoryError``) or iterated for
ever. An explicit list of more triples than this may still be run whole (its own length
is the bound then: the list is already there)."""


def _check_steps(steps: object, most: int = MAX_STEPS) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if steps > most:
        raise ValueError(
            f"steps must be at most {most} (dmuon.kernels.coefficients.MAX_STEPS; the tuned "
            f"schedules converge in about 5 steps, the cubic in about 40), got {steps!r}"
        )


def resolve_coefficients(coefficients: str | Sequence[Sequence[float]], steps: int) -> Schedule:
    """Turn a set name or an explicit list of triples into exactly ``steps`` triples.

    An explicit list is used as given when ``steps`` equals its length; shorter
    lists repeat their last triple, longer ones are truncated. ``steps`` is at most
    :data:`MAX_STEPS` (or the list's length, if longer).
    """
    _check_steps(
        steps, MAX_STEPS if isinstance(coefficients, str) else _explicit_most(coefficients)
    )
    if isinstance(coefficients, str):
        return get_coefficients(coefficients, steps)
    if not isinstance(coefficients, Iterable):
        raise ValueError(
            f"coefficients must be a set's name ({sorted(COEFFICIENT_SETS)}) or a list of "
            f"(a, b, c) triples, got {coefficients!r}"
        )
    triples: list[Triple] = []
    for i, t in enumerate(coefficients):
        if isinstance(t, (str, bytes)) or not hasattr(t, "__len__") or len(t) != 3:
            raise ValueError(
                f"coefficients[{i}] must be an (a, b, c) triple, got {t!r}: coefficients is a "
                "set's name or a list of triples (a flat (a, b, c)? wrap it: [(a, b, c)])"
            )
        triple = tuple(_real(x) for x in t)
        if None in triple or not all(math.isfinite(x) for x in triple if x is not None):
            raise ValueError(
                f"coefficients[{i}] must be three finite real numbers (a, b, c), got {t!r}"
            )
        triples.append(triple)  # type: ignore[arg-type]
    if not triples:
        raise ValueError("coefficients must hold at least one (a, b, c) triple")
    return CoefficientSet("custom", tuple(triples), "", 0.0, (0.0, 0.0)).triples(steps)


def _explicit_most(coefficients: object) -> int:
    """The most steps an explicit list of triples may run: :data:`MAX_STEPS`, or its own
    length if longer."""
    try:
        return max(MAX_STEPS, len(coefficients))  # type: ignore[arg-type]
    except TypeError:
        return MAX_STEPS


def _real(x: object) -> float | None:
    """``float(x)`` for a real number (a Python, numpy or 0-d torch one), else None."""
    if isinstance(x, (bool, str, bytes)):
        return None
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        return None


def ns_scalar_map(
    coefficients: str | Sequence[Sequence[float]], sigma: torch.Tensor, steps: int = 5
) -> torch.Tensor:
    """Apply the composed scalar polynomial of a schedule to singular values.

    ``σ_{k+1} = a_k σ_k + b_k σ_k³ + c_k σ_k⁵``. Newton–Schulz acts on every singular
    value independently, so for ``X = U Σ Vᵀ`` with ``‖X‖_2 ≤ 1`` the iteration
    returns ``U φ(Σ) Vᵀ`` with ``φ = ns_scalar_map``.

    Examples:
        >>> import torch
        >>> ns_scalar_map("polar_express", torch.tensor([1e-2, 0.5, 1.0], dtype=torch.float64))
        tensor([...], dtype=torch.float64)
    """
    s = sigma
    for a, b, c in resolve_coefficients(coefficients, steps):
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return s
