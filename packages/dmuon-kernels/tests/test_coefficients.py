import pytest
import torch

from dmuon.kernels import COEFFICIENT_SETS, get_coefficients, ns_scalar_map
from dmuon.kernels.coefficients import resolve_coefficients


def test_keller_is_one_triple_every_step():
    assert get_coefficients("keller", 5) == ((3.4445, -4.7750, 2.0315),) * 5


def test_you_is_the_published_five_step_schedule():
    you = get_coefficients("you", 5)
    assert you[0] == (4.0848, -6.8946, 2.9270)
    assert you[-1] == (2.8366, -3.0525, 1.2012)
    assert len(set(you)) == 5


def test_polar_express_is_raw_divided_by_safety_factor():
    # DMuon / Gram-NS variant: a/1.05, b/1.05³, c/1.05⁵ on every triple.
    raw = get_coefficients("polar_express_raw", 8)
    safe = get_coefficients("polar_express", 8)
    for (a, b, c), (a2, b2, c2) in zip(raw, safe, strict=True):
        assert a2 == pytest.approx(a / 1.05, rel=1e-15)
        assert b2 == pytest.approx(b / 1.05**3, rel=1e-15)
        assert c2 == pytest.approx(c / 1.05**5, rel=1e-15)


def test_polar_express_raw_converges_to_its_last_polynomial():
    raw = get_coefficients("polar_express_raw", 10)
    assert raw[7:] == ((1.875, -1.25, 0.375),) * 3
    # p(x) = 1.875x − 1.25x³ + 0.375x⁵ has the fixed point 1 with zero slope.
    a, b, c = raw[-1]
    assert a + b + c == pytest.approx(1.0)
    assert a + 3 * b + 5 * c == pytest.approx(0.0)


def test_schedules_repeat_their_last_triple_and_truncate():
    assert get_coefficients("you", 7)[5:] == (get_coefficients("you", 5)[-1],) * 2
    assert get_coefficients("polar_express", 3) == get_coefficients("polar_express", 5)[:3]


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
def test_documented_band_holds_on_the_promised_interval(name):
    cset = COEFFICIENT_SETS[name]
    lo = torch.tensor(cset.lower, dtype=torch.float64)
    sigma = torch.cat(
        [
            torch.logspace(torch.log10(lo), 0.0, 20001, dtype=torch.float64),
            torch.linspace(cset.lower, 1.0, 20001, dtype=torch.float64),
        ]
    )
    out = ns_scalar_map(name, sigma, 5)
    assert out.min() >= cset.band[0]
    assert out.max() <= cset.band[1]
    # Below the promised interval the map stays in [0, 1.21] and is increasing at 0.
    tiny = torch.logspace(-8, torch.log10(lo).item(), 2001, dtype=torch.float64)
    small = ns_scalar_map(name, tiny, 5)
    assert (small >= 0).all() and (small <= 1.21).all()
    assert torch.all(small[1:200] > small[:199])


def test_explicit_triples_are_accepted():
    assert resolve_coefficients([(2.0, -1.5, 0.5)], 3) == ((2.0, -1.5, 0.5),) * 3
    # any rows of three numbers: a tensor's too
    assert resolve_coefficients(torch.tensor([[2.0, -1.5, 0.5]]), 3) == ((2.0, -1.5, 0.5),) * 3


@pytest.mark.parametrize(
    ("coefficients", "steps", "match"),
    [
        ("nope", 5, "unknown coefficient set 'nope'"),
        ([(1.0, 2.0)], 5, r"coefficients\[0\] must be an \(a, b, c\) triple"),
        ([], 5, "at least one"),
        ((3.4, -4.7, 2.0), 5, r"coefficients\[0\] must be an \(a, b, c\) triple, got 3.4"),
        ("keller", 0, "steps must be a positive integer"),
        ("keller", 2.5, "steps must be a positive integer"),
    ],
)
def test_bad_coefficients_raise_naming_the_value(coefficients, steps, match):
    with pytest.raises(ValueError, match=match):
        resolve_coefficients(coefficients, steps)


@pytest.mark.parametrize("steps", [2.5, 0, True])
def test_get_coefficients_names_a_bad_step_count(steps):
    """A step count that is not a positive integer is named (``2.5``: ``TypeError: can't
    multiply sequence by non-int`` before)."""
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        get_coefficients("keller", steps)
