"""dmuon.comm.process_groups.twin_groups: one twin per process, rank set and purpose.

torch.distributed never frees a group nobody destroys: a twin made per call would leak
a communicator with every optimizer and every dedicate() (built, or refused). Real
processes, gloo, world 2.
"""

import pytest
import torch
import torch.distributed as dist

from dmuon.comm.process_groups import twin_groups
from dmuon.comm.testing import run_on_ranks


def _groups() -> int:
    # torch has no public listing of the live groups; c10d's registry is the count
    return len(dist.distributed_c10d._world.pg_map)


def _reused(rank, world):
    before = _groups()
    first = twin_groups([None], purpose="agreement")[0]
    for _ in range(5):  # every later optimizer of the process
        assert twin_groups([None])[0] is first  # "agreement" is the default
    other = twin_groups([None], purpose="presence")[0]
    assert other is not first  # another purpose: a communicator of its own
    made = _groups() - before
    assert made == 2, made
    assert dist.get_process_group_ranks(other) == list(range(world))
    sums = []
    for g in (first, other):  # working communicators over the same ranks
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=g)
        sums.append(t.item())
    return sums


def test_twins_are_reused_per_ranks_and_purpose():
    assert run_on_ranks(_reused, 2, timeout=60) == [[3.0, 3.0], [3.0, 3.0]]


def test_purpose_must_be_named():
    with pytest.raises(ValueError, match="purpose must be a non-empty str, got ''"):
        twin_groups([None], purpose="")
