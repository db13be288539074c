import pytest
import torch

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
