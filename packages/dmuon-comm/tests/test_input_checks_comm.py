"""Arguments of ``plan_owners`` and ``MatrixItem`` refused with a ValueError naming them,
where they used to be accepted (a negative ``ilp_gap``, ``spread_layers="no"``, string
costs, complex items) or fail inside with an error naming neither (``float()`` of a cost
function's ``None``, ``list(None)`` of a held entry, ``tuple(None)`` of a shape)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from dmuon.comm import MatrixItem, plan_owners

ITEMS = [MatrixItem("a", (4, 6)), MatrixItem("b", (8, 8)), MatrixItem("c", (2, 3))]


@pytest.mark.parametrize("gap", [-1.0, -1e-9, math.nan, -math.inf, "0.1", None, True])
def test_ilp_gap_must_be_a_number_at_least_zero(gap):
    """scipy's HiGHS only warned ("Invalid option value") and solved with its own gap."""
    with pytest.raises(ValueError, match=r"ilp_gap must be a relative gap ≥ 0.*got"):
        plan_owners(ITEMS, 2, strategy="ilp", ilp_gap=gap)


@pytest.mark.parametrize("limit", ["10", None])
def test_ilp_time_limit_that_is_not_a_number_is_named(limit):
    with pytest.raises(ValueError, match="ilp_time_limit must be > 0 seconds"):
        plan_owners(ITEMS, 2, ilp_time_limit=limit)


@pytest.mark.parametrize("flag", ["spread_layers", "refine"])
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_the_flags_must_be_bools(flag, value):
    """``spread_layers="no"`` is truthy: it turned the constraint on."""
    with pytest.raises(ValueError, match=rf"{flag} must be True or False, got {value!r}"):
        plan_owners(ITEMS, 2, **{flag: value})


@pytest.mark.parametrize("result", ["x", None, [1.0], True, 1 + 2j])
def test_a_cost_function_must_return_numbers(result):
    with pytest.raises(ValueError, match=r"cost: the cost function must return a number.*item 'a'"):
        plan_owners(ITEMS, 2, cost=lambda item: result)


@pytest.mark.parametrize("value", ["1", None, b"1", True])
def test_a_cost_mapping_must_hold_numbers(value):
    """``{"a": "1"}`` was read as 1.0 by ``float()``."""
    with pytest.raises(ValueError, match=r"cost: the mapping's costs must be numbers.*'a'"):
        plan_owners(ITEMS, 2, cost={"a": value, "b": 1.0, "c": 1.0})


def test_numeric_costs_of_every_kind_still_plan_the_same():
    table = {"a": 3.0, "b": 2.0, "c": 1.0}
    reference = plan_owners(ITEMS, 2, cost=table)
    kinds = [
        {"a": 3, "b": 2, "c": 1},
        {k: np.float32(v) for k, v in table.items()},
        {k: torch.tensor(v) for k, v in table.items()},
        {**table, "unplanned": "ignored"},  # entries for no item are not read
    ]
    for cost in kinds:
        assert plan_owners(ITEMS, 2, cost=cost).owners == reference.owners
    assert plan_owners(ITEMS, 2, cost=lambda item: table[item.name]).owners == reference.owners
    assert (
        plan_owners(ITEMS, 2, cost=lambda item: np.float64(table[item.name])).owners
        == reference.owners
    )


def test_good_ilp_options_and_flags_still_plan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Invalid option value" from scipy
        for gap in (0, 0.0, 1e-3, 0.5, np.float64(1e-3), math.inf):
            plan_owners(ITEMS, 2, strategy="ilp", ilp_gap=gap, ilp_time_limit=5)
    for spread in (True, False):
        for refine in (True, False):
            plan_owners(ITEMS, 2, spread_layers=spread, refine=refine)


@pytest.mark.parametrize(
    ("held", "match"),
    [
        ([None, []], r"held\[0\] must be a list of the MatrixItems rank 0 steps"),
        ([[], 3], r"held\[1\] must be a list of the MatrixItems rank 1 steps"),
        ([[], "ab"], r"held\[1\] must be a list"),
        ([MatrixItem("h", (2, 2)), []], r"held\[0\] must be a list"),
        (5, r"held must be None or one list of MatrixItems per rank \(2 lists\)"),
        ("ab", r"held must be None or one list"),
    ],
)
def test_held_entries_that_are_not_lists_are_named(held, match):
    with pytest.raises(ValueError, match=match):
        plan_owners(ITEMS, 2, held=held)


def test_held_lists_of_any_sequence_kind_still_plan():
    held = (iter([MatrixItem("h", (8, 8))]), ())
    plan = plan_owners(ITEMS, 2, held=held)
    assert plan.loads[0] > 0


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.bool])
def test_a_matrix_item_refuses_the_dtypes_its_error_does_not_list(dtype):
    with pytest.raises(
        ValueError,
        match=rf"item 'x': dtype must be a torch.dtype or one of \[.*\(those dtypes only\), "
        rf"got {dtype}",
    ):
        MatrixItem("x", (4, 6), dtype)


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8],
)
def test_a_matrix_item_takes_the_listed_dtypes_as_before(dtype):
    assert MatrixItem("x", (4, 6), dtype).dtype == dtype
    assert MatrixItem("x", (4, 6), str(dtype)).dtype == dtype


@pytest.mark.parametrize("shape", [None, 5, 2.0])
def test_a_matrix_item_shape_that_is_not_a_sequence_is_named(shape):
    with pytest.raises(ValueError, match=rf"item 'x': shape must be \(m, n\).*got {shape!r}"):
        MatrixItem("x", shape)  # type: ignore[arg-type]
