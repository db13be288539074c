"""all_gather_chunks puts torch.chunk's blocks back together (real gloo ranks)."""

import torch

from dmuon.comm import CommStats
from dmuon.comm.chunk_gather import all_gather_chunks
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
