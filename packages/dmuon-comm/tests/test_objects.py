"""all_gather_objects: every rank's object in rank order, with and without numpy."""

import subprocess
import sys

import pytest

from dmuon.comm import all_gather_objects
from dmuon.comm.testing import run_on_ranks


def _gather(rank: int, world: int):
    # uneven payloads: rank r sends r + 1 entries
    return all_gather_objects({"rank": rank, "items": list(range(rank + 1)), "text": "é" * rank})


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_every_object_in_rank_order(world):
    results = run_on_ranks(_gather, world, timeout=60)
    expected = [{"rank": r, "items": list(range(r + 1)), "text": "é" * r} for r in range(world)]
    assert results == [expected] * world


def test_one_process_returns_its_own_object():
    assert all_gather_objects(("a", 1)) == [("a", 1)]


def test_works_without_numpy():
    """torch's all_gather_object needs numpy; this one must not (numpy is no dependency)."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "from dmuon.comm.testing import run_on_ranks\n"
        "from dmuon.comm import all_gather_objects\n"
        "def f(rank, world):\n"
        "    return all_gather_objects(rank * 'x')\n"
        "if __name__ == '__main__':\n"
        "    print(run_on_ranks(f, 2, timeout=60))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[['', 'x'], ['', 'x']]" in out.stdout


def test_small_host_tensors_go_where_the_backend_takes_them(monkeypatch):
    """``flag_device``: the CPU for gloo and for torch's default ``"cpu:gloo,cuda:nccl"``
    group, the current CUDA device for NCCL alone (``init_process_group("nccl")``), which
    has no CPU collectives: DMuon's flags, counts and digests must travel there."""
    import torch
    import torch.distributed as dist

    from dmuon.comm.flags import flag_device

    assert flag_device(None) == torch.device("cpu")  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in [
        ("gloo", torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cpu")),
        ("nccl", torch.device("cuda", 3)),
        ("cuda:nccl", torch.device("cuda", 3)),
    ]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert flag_device(None) == device, backend
