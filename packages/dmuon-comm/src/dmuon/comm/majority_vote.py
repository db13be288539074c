"""Majority vote of signs across ranks (Sign-Muon, signSGD with majority vote).

Sign-Muon (Mishra, Trivedi & Kumar, *Communication-Efficient Distributed Muon
Optimization*, 2026) orthogonalises each rank's local momentum and exchanges only
the signs: the step direction is ``S = sign(Σ_ranks sign(U_rank))``. The paper
does not fix a tie rule; here a tie (as many ``+`` as ``−``, possible for an even
number of ranks) gives ``+1``, the same rule as ``sign(0) = +1`` in
:func:`~dmuon.comm.pack_signs`. So ``S = +1`` exactly when at least half of the
ranks vote ``+``, for both methods.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.process_groups import group_size
from dmuon.comm.signs import pack_bits, pack_signs, plus_minus, unpack_bits, unpack_signs
from dmuon.comm.stats import CommStats, default_stats
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["VOTE_METHODS", "majority_vote"]

VOTE_METHODS = ("packed", "int8")
"""Values of ``majority_vote(method=...)``: bit-packed all-to-all + all-gather, or an int8
SUM all-reduce; both break ties the same way (towards +)."""


def majority_vote(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    method: str = "packed",
    dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Elementwise majority of the signs of ``x`` over the ranks of ``group``.

    ``result = +1`` where at least half of the ranks have ``x ≥ 0`` (zero counts as
    ``+``; a tie gives ``+``), ``−1`` elsewhere. Both methods give exactly the same
    result.

    * ``"int8"``: an all-reduce (SUM) of ``±1`` as int8 (int32 when the group has
      more than 127 ranks, so the sum cannot overflow), then ``+1`` where the sum is
      ``≥ 0``. Bytes: ``2(N−1)/N · numel`` per rank, 1/4 of an fp32 all-reduce.
    * ``"packed"`` (default): signs packed 8 per byte and padded so the packed
      tensor splits into ``N`` equal chunks; an all-to-all sends chunk ``r`` of every
      rank to rank ``r``, which counts the ``+`` votes per position (a popcount over
      the ranks) and packs the majority; an all-gather of the packed majorities
      gives everyone the result. Sign bits do not add, hence vote-then-gather
      rather than an all-reduce (as in signSGD with majority vote, Bernstein et al.
      2019). Bytes: ``2(N−1)/N · numel/8`` per rank, 1/32 of an fp32 all-reduce
      (plus padding to a multiple of ``8N`` entries).

    The call is synchronous (the vote sits between the two transfers).

    Args:
        x: this rank's values (any real dtype, shape and memory layout).
        group: process group; default the world (a single process without
            torch.distributed votes alone).
        method: ``"packed"`` or ``"int8"``.
        dtype: dtype of the result; default ``x.dtype`` for floating ``x``, else
            float32.
        stats: where to record bytes; default :func:`~dmuon.comm.default_stats`.

    Returns:
        A tensor shaped like ``x`` holding ``±1``.

    Raises:
        ValueError: unknown ``method``, or a complex or boolean ``x``.

    Examples:
        >>> import torch
        >>> majority_vote(torch.tensor([0.3, -2.0, 0.0]))  # one rank: its own signs
        tensor([ 1., -1.,  1.])
    """
    if method not in VOTE_METHODS:
        raise ValueError(f"method must be one of {VOTE_METHODS}, got {method!r}")
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"majority_vote needs a real numeric tensor, got dtype {x.dtype}")
    out_dtype = dtype or (x.dtype if x.is_floating_point() else torch.float32)
    stats = stats if stats is not None else default_stats()
    n = group_size(group)
    name = f"majority_vote[{method}]"
    stats.count_call(name)
    if n == 1 or x.numel() == 0:
        return plus_minus(x >= 0, out_dtype)
    if method == "int8":
        vote_dtype = torch.int8 if n <= 127 else torch.int32
        votes = plus_minus(x.reshape(-1) >= 0, vote_dtype)
        wait_work(
            dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=group, async_op=True),
            "majority vote all-reduce",
            group,
        )
        stats.record_collective(name, "all_reduce", nbytes=votes.nbytes, world_size=n)
        return plus_minus(votes >= 0, out_dtype).reshape(x.shape)

    # packed: pad to a multiple of 8·N entries so the packed bytes split evenly.
    numel = x.numel()
    padded = -(-numel // (8 * n)) * (8 * n)
    bits = torch.ones(padded // 8, dtype=torch.uint8, device=x.device)
    packed = pack_signs(x)
    bits[: packed.numel()] = packed
    chunk = bits.numel() // n
    received = torch.empty_like(bits)
    wait_work(
        dist.all_to_all_single(received, bits, group=group, async_op=True),
        "majority vote all-to-all",
        group,
    )
    stats.record(
        name,
        collectives=1,
        payload_bytes=bits.nbytes,
        bytes_sent=(n - 1) * chunk,
        bytes_received=(n - 1) * chunk,
        calls=0,
    )
    # received[r] is rank r's chunk for the positions this rank votes on: count
    # the + votes per position (a popcount over the ranks) and pack the majority.
    plus_votes = unpack_bits(received.view(n, chunk)).sum(dim=0, dtype=torch.int32)
    mine = pack_bits((2 * plus_votes >= n).to(torch.uint8))  # tie → +
    result = torch.empty_like(bits)
    wait_work(
        all_gather_single(result, mine, group=group, async_op=True),
        "majority vote all-gather",
        group,
    )
    stats.record_collective(name, "all_gather", nbytes=mine.nbytes, world_size=n)
    return unpack_signs(result, x.shape, dtype=out_dtype)
