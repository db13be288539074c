"""dmuon.comm's Newton–Schulz FLOP count (the owner cost) equals dmuon.kernels.ns_flops.

dmuon.comm may not import dmuon.kernels, so it restates the count in closed form;
this test holds the two together over shapes, step counts, restart sets and both
methods, so that a change to the kernels' iteration cannot silently unbalance
the owner plans.
"""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dmuon.comm
import dmuon.kernels

SHAPES = [
    (1, 1),
    (1, 7),
    (7, 1),
    (64, 64),
    (96, 300),
    (300, 96),
    (768, 3072),
    (4096, 1024),
    (1024, 14336),
    (5, 0),
    (0, 5),
]
STEPS = [0, 1, 2, 3, 5, 6, 8]
RESTARTS = [(), (1,), (2,), (2, 4), (1, 2, 3), (0, 2), (2, 9), (4, 2, 2)]


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize(("m", "n"), SHAPES)
def test_grid(method, m, n):
    for steps, restarts in itertools.product(STEPS, RESTARTS):
        for batch in (1, 3):
            kw = {"method": method, "steps": steps, "restarts": restarts, "batch": batch}
            assert dmuon.comm.ns_flops(m, n, **kw) == dmuon.kernels.ns_flops(m, n, **kw), kw


@given(
    m=st.integers(0, 5000),
    n=st.integers(0, 5000),
    method=st.sampled_from(["gram", "standard"]),
    steps=st.integers(0, 12),
    restarts=st.lists(st.integers(0, 13), max_size=5),
    batch=st.integers(0, 16),
)
def test_random(m, n, method, steps, restarts, batch):
    kw = {"method": method, "steps": steps, "restarts": tuple(restarts), "batch": batch}
    assert dmuon.comm.ns_flops(m, n, **kw) == dmuon.kernels.ns_flops(m, n, **kw)


def test_default_owner_cost_uses_that_count():
    item = dmuon.comm.MatrixItem("w", (1024, 4096))
    cost = dmuon.comm.NSCost(bytes_per_second=float("inf"), call_overhead=0.0, byte_passes=0)
    assert cost(item) == dmuon.kernels.ns_flops(1024, 4096) / cost.flops_per_second
