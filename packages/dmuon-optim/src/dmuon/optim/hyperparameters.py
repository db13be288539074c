"""Hyperparameter specifications: defaults, checks and the normalised plain values.

Every key a parameter group may carry is declared here (the keys common to all
matrix rules, the scalar optimizers' keys) or by a transform of the rule's chain
(:mod:`dmuon.optim.transforms`, from which :class:`~dmuon.optim.Rule` derives its
options). A key that is declared nowhere is an error that names
it and lists the accepted ones: a silently ignored ``betas`` is a known trap.
Values are normalised to plain Python values (floats, ints, bools, strings,
tuples) so that ``param_groups`` and state dicts hold nothing else.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dmuon.kernels import COEFFICIENT_SETS, METHODS
from dmuon.kernels.coefficients import resolve_coefficients
from dmuon.optim.scaling import ADJUST_LR

__all__ = [
    "BOOKKEEPING_KEYS",
    "COMPUTE_DTYPES",
    "FLOAT32_MAX",
    "MATRIX_KEYS",
    "NS_STEPS_MAX",
    "REQUIRED",
    "SCALAR_OPTIONS",
    "STATE_ROUNDING",
    "Option",
    "boolean",
    "choice",
    "integer",
    "matrix_keys",
    "optional",
    "real",
]

Check = Callable[[Any], Any]

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


STATE_ROUNDING = ("nearest", "stochastic")
"""How low-precision matrix state is rounded on write (:mod:`dmuon.optim.state_precision`)."""


class _Required:
    """The type of :data:`REQUIRED` (copies and pickles are :data:`REQUIRED` itself)."""

    def __repr__(self) -> str:
        return "REQUIRED"

    def __reduce__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""The default of an :class:`Option` that has none of its own: the rule that chains the
transform declaring it must give one (``Rule(..., defaults={key: value})``), or the
key must be a common matrix key (filled from the ``DMuon`` constructor)."""


@dataclass(frozen=True)
class Option:
    """A hyperparameter: its default, how it is checked and normalised, what it means.

    Transforms declare the keys they read as options (``Transform.hyperparameters``),
    as they declare their state; the check normalises a value to a plain Python value
    of the key's type (``real`` → ``float``, ``integer`` → ``int``, ``boolean``,
    ``choice``), so two declarations of one key agree only if they are the same
    option (same default, same check).

    Attributes:
        default: the value a group gets when neither it nor the caller gives one;
            :data:`REQUIRED` where there is none.
        check: validates a value and returns it normalised; raises ``ValueError``.
        doc: one line, what it means.

    Examples:
        >>> beta2 = Option(0.95, real(0.0, 1.0, hi_open=True), "EMA decay")
        >>> beta2.check(0), beta2.default
        (0.0, 0.95)
    """

    default: Any
    check: Check
    doc: str


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest real a hyperparameter may hold (≈ 3.4e38): the step computes in float32
(fp16/bf16 parameters in fp32 too) and hands torch's kernels its scalars as such, so a
value past it (``lr=1e300``, finite in Python's float64) failed mid-step, after earlier
groups had stepped, with torch's ``value cannot be converted to type float without
overflow``."""


def real(
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Check:
    """A finite real number in the interval, of magnitude at most :data:`FLOAT32_MAX`;
    returned as ``float``.

    A one-element real tensor (an ``lr`` tensor, as ``torch.optim`` takes it)
    is checked by its value and returned as itself: the group keeps the caller's tensor,
    so that a change made to it in place reaches the next step, as in ``torch.optim``
    (``DMuon.step`` re-checks it and reads its value at every step).
    """
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    if hi == math.inf:
        what = f"a finite real number {'>' if lo_open else '>='} {lo}"
    else:
        what = f"a real number in {left}{lo}, {hi}{right}"

    def check(value: Any) -> Any:
        if (
            isinstance(value, torch.Tensor)
            and value.numel() == 1
            and value.dtype != torch.bool
            and not value.is_complex()
        ):
            check(value.item())  # its value now; the caller's tensor stays in the group
            return value
        if isinstance(value, str) and _parses_as_float(value):
            # YAML 1.1 (PyYAML) reads 1e-3 as a string; so does argparse without type=float
            raise ValueError(
                f"must be {what}, got the string {value!r}: pass a number, "
                f"float({value!r}) (a YAML file or the command line gives a string)"
            )
        # numbers.Real: numpy's scalars too (a schedule computed with numpy), not bool
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"must be {what}, got {value!r}")
        try:
            v = float(value)
        except OverflowError:  # an int past float's range (10**400)
            raise ValueError(f"must be {what}, got {value!r}") from None
        if math.isfinite(v) and abs(v) > FLOAT32_MAX:
            raise ValueError(
                f"must be {what} and at most {FLOAT32_MAX:.4g} in magnitude (float32's "
                f"largest: the step computes in float32), got {value!r}"
            )
        ok = math.isfinite(v)
        ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            raise ValueError(f"must be {what}, got {value!r}")
        return v

    return check


def integer(lo: int, hi: int | None = None) -> Check:
    """An integer ``≥ lo`` (and ``≤ hi`` when given); returned as ``int``."""

    def check(value: Any) -> int:
        # numbers.Integral: numpy's integers too, not bool
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
            raise ValueError(f"must be an integer >= {lo}, got {value!r}")
        if hi is not None and int(value) > hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}], got {value!r}")
        if int(value) >= 2**63:  # no loop count or index is meant (10**400 overflowed later)
            raise ValueError(f"must be an integer >= {lo} and < 2**63, got {value!r}")
        return int(value)

    return check


def choice(values: Sequence[Any]) -> Check:
    """One of ``values`` (compared with ``==``)."""

    def check(value: Any) -> Any:
        if isinstance(value, bool) and not any(isinstance(v, bool) for v in values):
            raise ValueError(f"must be one of {list(values)}, got {value!r}")
        if value not in values:
            raise ValueError(f"must be one of {list(values)}, got {value!r}")
        return value

    return check


def boolean(value: Any) -> bool:
    """``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"must be True or False, got {value!r}")
    return value


def optional(inner: Check) -> Check:
    """``None`` or whatever ``inner`` accepts."""

    def check(value: Any) -> Any:
        return None if value is None else inner(value)

    return check


def _betas(value: Any) -> tuple[float, float]:
    try:
        b1, b2 = value
    except (TypeError, ValueError):
        raise ValueError(f"must be a pair (beta1, beta2) in [0, 1), got {value!r}") from None
    unit = real(0.0, 1.0, hi_open=True)
    try:
        # plain floats, a one-element tensor's value too: torch's AdamW refuses a tensor
        # beta (foreach, not capturable) at the step, after the matrix groups stepped
        return float(unit(b1)), float(unit(b2))
    except ValueError:
        raise ValueError(f"must be a pair (beta1, beta2) in [0, 1), got {value!r}") from None


def _coefficients(value: Any) -> str | tuple[tuple[float, float, float], ...]:
    if isinstance(value, str):
        if value not in COEFFICIENT_SETS:
            raise ValueError(f"must be one of {sorted(COEFFICIENT_SETS)} or (a, b, c) triples")
        return value
    try:
        triples = tuple(value)
        if not triples:
            raise ValueError("no triple given")
        resolve_coefficients(triples, len(triples))  # three finite numbers each, or raises
        out = tuple((float(a), float(b), float(c)) for a, b, c in triples)
        if any(abs(x) > FLOAT32_MAX for t in out for x in t):
            # finite in float64, yet the iteration's float32 scalar overflowed mid-step
            raise ValueError(f"a coefficient is past float32's largest, {FLOAT32_MAX:.4g}")
        return out
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"must be one of {sorted(COEFFICIENT_SETS)} or a sequence of (a, b, c) triples, "
            f"got {value!r} ({e})"
        ) from None


def _dtype_name(value: Any) -> str | None:
    """The :data:`COMPUTE_DTYPES` name of ``value`` (a name or a ``torch.dtype``), else None."""
    if isinstance(value, torch.dtype):
        return {v: k for k, v in COMPUTE_DTYPES.items()}.get(value)
    return value if isinstance(value, str) and value in COMPUTE_DTYPES else None


def _compute_dtype(value: Any) -> str | None:
    if value is None:
        return None
    name = _dtype_name(value)
    if name is not None:
        return name
    raise ValueError(f"must be None or one of {sorted(COMPUTE_DTYPES)}, got {value!r}")


def _state_dtype(value: Any) -> str | None:
    if value is None:
        return None
    name = _dtype_name(value)
    if name is not None:
        return name
    raise ValueError(
        f"must be None (the parameter's dtype) or a floating-point dtype, one of "
        f"{sorted(COMPUTE_DTYPES)} or the torch.dtype of one; got {value!r}"
    )


def _sizes(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        sizes = tuple(value)
    except TypeError:
        raise ValueError(
            f"must be None or a sequence of positive integers, got {value!r}"
        ) from None
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"must be None or a sequence of positive integers, got {value!r}")
    return tuple(int(s) for s in sizes)


def _heads(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"must be a positive integer, a tuple of them, or None, got {value}")
        return int(value)
    return _sizes(value)


NS_STEPS_MAX = 100
"""The most Newton–Schulz steps a group may take. The tuned quintic sets converge in
about 5 and the classical cubic (1.5, −0.5, 0) from a singular value of 1e-7 in about
40; more is never meant, and ``ns_steps=2**62`` built a schedule of that many triples
(``MemoryError``) or iterated for ever."""

TP_PATHS = ("auto", "gram", "gather")
"""The values of the group key ``tp_path``: how a matrix split over a tensor-parallel
group is orthogonalised (:meth:`StepContext.orthogonalize
<dmuon.optim.transforms.StepContext.orthogonalize>`)."""

# Keys every matrix group has, whatever its rule. Defaults of the first four come
# from the DMuon constructor.
MATRIX_KEYS: dict[str, Option] = {
    "lr": Option(None, real(0.0), "learning rate (≥ 0)"),
    "momentum": Option(None, real(0.0, 1.0, hi_open=True), "momentum μ in [0, 1)"),
    "nesterov": Option(None, boolean, "Nesterov look-ahead G + μM instead of M"),
    "weight_decay": Option(None, real(0.0), "decoupled weight decay: W ← W(1 − lr·wd)"),
    "cautious_weight_decay": Option(
        None,
        boolean,
        "decay only the entries whose update agrees in sign with the weight: "
        "W ← W − lr·wd·𝟙[U⊙W ≥ 0]⊙W (arXiv 2510.12402)",
    ),
    "adjust_lr": Option(None, choice(ADJUST_LR), "learning-rate convention of the shape"),
    "ns_method": Option(None, choice(METHODS), "Newton–Schulz iteration: gram or standard"),
    "ns_coefficients": Option(None, _coefficients, "coefficient set name or (a, b, c) triples"),
    "ns_steps": Option(
        None,
        integer(1, NS_STEPS_MAX),
        f"Newton–Schulz steps, 1 to {NS_STEPS_MAX}",
    ),
    "ns_compute_dtype": Option(
        None,
        _compute_dtype,
        "dtype of the Newton–Schulz matmuls; None = per device (bf16 on CPU, fp16 Gram on CUDA)",
    ),
    "state_dtype": Option(
        None,
        _state_dtype,
        "dtype the rule's state (momentum, second moments) is stored in, math in fp32; "
        "None = the parameter's dtype",
    ),
    "state_rounding": Option(
        None,
        choice(STATE_ROUNDING),
        "rounding of low-precision state on write: nearest (ties to even) or stochastic",
    ),
    "flatten": Option(
        None,
        optional(boolean),
        "parameters with more than 2 dims: True = one (dim0, rest) matrix (conv), "
        "False = a batch of matrices over the leading dims (expert stacks)",
    ),
    "transposed": Option(
        None,
        boolean,
        "2-D weights stored (in, out), Hugging Face's Conv1D, or with flatten=True conv "
        "weights stored (in, out, *kernel), nn.ConvTranspose with groups=1: the rule sees "
        "each as its transpose (out, in·kernel), rows = output neurons (param_groups sets it)",
    ),
    "split_sizes": Option(
        None, _sizes, "row blocks orthogonalised separately (fused QKV), summing to the rows"
    ),
    "num_heads": Option(None, _heads, "split each (block's) rows into this many per-head matrices"),
    "tp_path": Option(
        None,
        choice(TP_PATHS),
        "a tensor-parallel matrix's polar factor: 'gram' on the shards, 'gather' whole, "
        "'auto' = the cheaper by dmuon.comm.tensor_parallel_path",
    ),
}


def matrix_keys(*names: str) -> dict[str, Option]:
    """The :data:`MATRIX_KEYS` entries of ``names``: how a transform declares that it reads
    common keys (their values come from the group, filled by the ``DMuon`` constructor).

    Examples:
        >>> sorted(matrix_keys("momentum", "nesterov"))
        ['momentum', 'nesterov']
    """
    return {name: MATRIX_KEYS[name] for name in names}


SCALAR_OPTIONS: dict[str, Option] = {
    "lr": Option(None, real(0.0), "learning rate (≥ 0)"),
    "betas": Option(None, _betas, "(beta1, beta2) in [0, 1)"),
    "eps": Option(None, real(0.0), "denominator guard"),
    "weight_decay": Option(None, real(0.0), "decoupled weight decay"),
    "cautious_weight_decay": Option(
        False,
        boolean,
        "decay only the entries whose update agrees in sign with the weight "
        "(arXiv 2510.12402); optional in a hand-built group (absent: plain decay)",
    ),
}
"""The keys of the scalar optimizers (:data:`~dmuon.optim.SCALAR_RULES` picks its own
from them); their defaults come from the ``DMuon`` constructor (``adamw_*``)."""

# Keys that carry no hyperparameter: what the group holds and bookkeeping written
# by torch's LR schedulers and SWA, which must survive a state-dict round trip.
BOOKKEEPING_KEYS = frozenset(
    {
        "params",
        "param_names",
        "rule",
        "name",
        "initial_lr",
        "max_lr",
        "min_lr",
        "base_lr",
        "swa_lr",
        "max_momentum",
        "base_momentum",
    }
)
