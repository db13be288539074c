"""dmuon.comm.torch_compat: the renamed collectives give torch's result on every torch.

The suite runs on the pinned torch (2.13: the new names) and, in ``nox -s compat``, on
torch 2.11 (the old names), so each branch is exercised by one of the two runs; the
test output says which one ran.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from dmuon.comm.testing import run_on_ranks
from dmuon.comm.torch_compat import (
    TORCH_VERSION,
    all_gather_single,
    reduce_scatter_single,
    uses_new_names,
)


def test_the_branch_follows_the_torch_release():
    print(f"torch {torch.__version__}: new collective names = {uses_new_names()}")
    assert uses_new_names() == (TORCH_VERSION >= (2, 13))
    assert uses_new_names() == hasattr(dist, "all_gather_single")


def _collectives(rank: int, world: int):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated name is never called
        warnings.simplefilter("error", DeprecationWarning)
        mine = torch.arange(3, dtype=torch.float32) + 10 * rank
        gathered = torch.empty(3 * world)
        all_gather_single(gathered, mine)
        work = all_gather_single(torch.empty(3 * world), mine, async_op=True)
        work.wait()
        full = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
        part = torch.empty(2)
        reduce_scatter_single(part, full)
    return gathered.tolist(), part.tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_and_reduce_scatter_match_their_definition(world):
    results = run_on_ranks(_collectives, world, timeout=60)
    gathered = [float(v + 10 * r) for r in range(world) for v in range(3)]
    scale = sum(r + 1 for r in range(world))  # Σ_r (r + 1): the SUM over ranks
    for rank, (got_gather, got_part) in enumerate(results):
        assert got_gather == gathered
        assert got_part == [float(scale * i) for i in (2 * rank, 2 * rank + 1)]
