"""The step's refusals name this rank's parameters, and say how many they left out.

``ThawedParameterError``, ``GradientChangedError`` and ``StaleGradientError`` show the
first three names; a fine-tuning run thawing six LoRA factors read three and could not
tell there were more (``err.names`` held all six).
"""

from types import SimpleNamespace

import pytest

from dmuon.optim.engine import guards

NAMES = [f"layers.{i}.q_proj.lora_{ab}.default.weight" for i in range(3) for ab in "AB"]


@pytest.mark.parametrize(
    "build",
    [
        lambda names: guards._thawed_error([0], names, SimpleNamespace(mode="owner"), 1),
        lambda names: guards._changed_error([0], names, SimpleNamespace(mode="owner")),
        lambda names: guards._stale_error([0], names),
    ],
    ids=["thawed", "changed", "stale"],
)
def test_a_long_list_says_how_many_more_the_error_holds(build):
    err = build(NAMES)
    assert err.names == NAMES
    assert f"on this rank: {NAMES[:3]} and 3 more (the error's .names lists all)" in str(err)
    short = build(NAMES[:2])
    assert f"on this rank: {NAMES[:2]}." in str(short) or f"{NAMES[:2]}:" in str(short)
    assert "more (the error's" not in str(short)
