import pytest
import torch

# torch.optim.Optimizer imports torch._dynamo at its first add_param_group: imported
# here once, the ranks that dmuon.comm.testing.run_on_ranks forks inherit it instead of
# each importing it again (several seconds of CPU per rank).
import torch._dynamo

# CI runs on 2 cores next to other jobs; keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restored after it.

    For tests of many tiny matrices, where a second thread only adds contention (on a
    busy machine, minutes). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
