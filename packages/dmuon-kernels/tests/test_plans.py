"""A Newton–Schulz call resolves its options once per (options, device, Gram size).

The plan (:class:`~dmuon.kernels.dispatch.CallPlan`) holds what every such call
decides the same way; a warm call must give bitwise the result of a fresh
resolution, must not ask the rules again, and must still reject every bad option
(an option equal to a planned one under ``==``, ``True`` for ``1``, included).
"""

from __future__ import annotations

import pytest
import torch

import dmuon.kernels.dispatch as dispatch
from dmuon.kernels import gram_newton_schulz, newton_schulz, orthogonalize


def test_a_warm_call_asks_the_backend_rule_no_more(monkeypatch):
    asked = []
    rule = dispatch.resolve_backend

    def counting(*args, **kwargs):
        asked.append(kwargs["gram_size"])
        return rule(*args, **kwargs)

    monkeypatch.setattr(dispatch, "resolve_backend", counting)
    G = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(0))
    first = orthogonalize(G, compute_dtype=torch.float32)
    again = [orthogonalize(G, compute_dtype=torch.float32) for _ in range(3)]
    assert asked == [24]
    assert all(torch.equal(o, first) for o in again)
    orthogonalize(torch.randn(16, 40), compute_dtype=torch.float32)  # another Gram size
    assert asked == [24, 16]


@pytest.mark.parametrize(
    ("call", "good", "bad"),
    [
        (orthogonalize, {"restarts": (1,)}, {"restarts": (True,)}),
        (orthogonalize, {"steps": 1, "restarts": ()}, {"steps": True}),
        (gram_newton_schulz, {"restarts": (2,)}, {"restarts": (2.0,)}),
        (newton_schulz, {"cuda_graph": True}, {"cuda_graph": 1}),
        (orthogonalize, {"backend": "torch"}, {"backend": "cuda"}),
    ],
)
def test_bad_options_are_rejected_after_a_plan_exists(call, good, bad):
    G = torch.randn(8, 12)
    call(G, **good)  # plans these options
    (name,) = bad
    with pytest.raises(ValueError, match=name):  # the error names the option
        call(G, **{**good, **bad})


def test_results_equal_across_entry_points_warm_or_cold():
    G = torch.randn(2, 32, 48, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        assert torch.equal(orthogonalize(G), gram_newton_schulz(G))
        assert torch.equal(orthogonalize(G, method="standard"), newton_schulz(G))
