"""all_gather_chunks puts torch.chunk's blocks back together (real gloo ranks);
padded_chunks cuts them out, padded (against torch.chunk itself)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon.comm import CommStats
from dmuon.comm.chunk_gather import all_gather_chunks, padded_chunks
from dmuon.comm.testing import run_on_ranks

# (shape, dim): even, uneven, fewer rows than ranks (empty blocks), a middle dimension
CASES = [((6, 4), 0), ((7, 3), 0), ((2, 5), 0), ((3, 8, 2), 1), ((4, 5), -1)]


def run_cases(rank, world):
    import torch.distributed as dist

    out = []
    for k, (shape, dim) in enumerate(CASES):
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(k))
        whole.view(-1)[0] = -0.0  # a copy keeps a negative zero
        mine = whole.chunk(world, dim)  # torch.chunk's blocks; missing ones are empty
        size = whole.shape[dim]
        local = mine[rank] if rank < len(mine) else whole.narrow(dim, size, 0)
        stats = CommStats()
        got = all_gather_chunks(
            local, dim, size, dist.group.WORLD, "test", stats=stats, stats_name="chunks"
        )
        out.append(
            (
                torch.equal(got.view(-1).view(torch.int32), whole.reshape(-1).view(torch.int32)),
                got.is_contiguous(),
                stats["chunks"].collectives,
                stats["chunks"].payload_bytes,
                -(-size // world) * whole.numel() // size * 4,
            )
        )
    return out


def test_all_gather_chunks_equals_the_whole_tensor_bitwise():
    for rank, cases in enumerate(run_on_ranks(run_cases, 3, timeout=60)):
        for case, (equal, contiguous, calls, sent, padded) in zip(CASES, cases, strict=True):
            assert equal and contiguous, (rank, case)
            assert calls == 1 and sent == padded, (rank, case, sent, padded)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=3),
    n=st.integers(1, 5),
    data=st.data(),
)
def test_padded_chunks_are_torch_chunks_blocks_zero_padded(shape, n, data):
    """Row ``r`` is ``torch.chunk``'s block ``r`` (empty past the blocks it makes), then
    zeros up to ``⌈size/n⌉``; the result is one contiguous ``(n, *block)`` tensor."""
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    whole = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    got = padded_chunks(whole, dim, n)
    size = whole.shape[dim]
    block = list(whole.shape)
    block[dim] = -(-size // n)
    assert tuple(got.shape) == (n, *block) and got.is_contiguous()
    chunks = whole.chunk(n, dim) if size else ()
    for r in range(n):
        mine = chunks[r] if r < len(chunks) else whole.narrow(dim, size, 0)
        length = mine.shape[dim]
        assert torch.equal(got[r].narrow(dim % whole.dim(), 0, length), mine)
        pad = got[r].narrow(dim % whole.dim(), length, block[dim] - length)
        assert torch.equal(pad, torch.zeros_like(pad))
