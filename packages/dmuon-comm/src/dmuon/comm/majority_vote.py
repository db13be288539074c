"""Majority vote of signs across ranks (Sign-Muon, signSGD with majority vote).

Sign-Muon (Mishra, Trivedi & Kumar, *Communication-Efficient Distributed Muon
Optimization*, 2026) orthogonalises each rank's local momentum and exchanges only
the signs: the step direction is

    S = sign(Σ_ranks sign(x_rank)),    sign(0) = 0,

the paper's integer sum of the signs, then its sign. A zero entry (``+0.0``, ``−0.0``;
also NaN) abstains, and a tie (as many ``+`` as ``−``) gives ``0``: the entry does not
move, as one process's ``sign(0) = 0`` does not move it
(:class:`~dmuon.optim.transforms.Sign`). So a vote of one rank is that rank's own signs,
and a rank without a gradient (zeros) leaves the others' majority as it is. A tie rule
towards either sign would move every tied entry the same way each step (with an even
number of ranks ties are common), a drift the gradients never asked for.

A vote takes three values, so the packed method sends five votes per byte (``3^5 = 243``
codes) rather than eight signs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon.comm.faults import wait_work
from dmuon.comm.process_groups import group_size
from dmuon.comm.signs import ABSTAIN, VOTES_PER_BYTE, pack_votes, ternary_signs, unpack_votes
from dmuon.comm.stats import CommStats, default_stats
from dmuon.comm.torch_compat import all_gather_single

__all__ = ["VOTE_METHODS", "majority_vote"]

VOTE_METHODS = ("packed", "int8")
"""Values of ``majority_vote(method=...)``: base-3 packed all-to-all + all-gather, or an
int8 SUM all-reduce; both give exactly the same result."""


def majority_vote(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    method: str = "packed",
    dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Elementwise majority of the signs of ``x`` over the ranks of ``group``.

    ``result = sign(Σ_ranks sign(x))`` with ``sign(0) = 0``: ``+1`` where more ranks have
    ``x > 0`` than ``x < 0``, ``−1`` where fewer, ``0`` on a tie (a zero or NaN entry
    does not vote). Both methods give exactly the same result.

    * ``"int8"``: an all-reduce (SUM) of the signs as int8 (int32 when the group has
      more than 127 ranks, so the sum cannot overflow), then its sign. Bytes:
      ``2(N−1)/N · numel`` per rank, 1/4 of an fp32 all-reduce.
    * ``"packed"`` (default): votes packed five per byte (base 3) and padded so the
      packed tensor splits into ``N`` equal chunks; an all-to-all sends chunk ``r`` of
      every rank to rank ``r``, which sums the votes per position and packs their
      sign; an all-gather of the packed majorities gives everyone the result. Packed
      votes do not add, hence vote-then-gather rather than an all-reduce (as in signSGD
      with majority vote, Bernstein et al. 2019). Bytes: ``2(N−1)/N · numel/5`` per
      rank, 1/20 of an fp32 all-reduce (plus padding to a multiple of ``5N`` entries).

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
        A tensor shaped like ``x`` holding ``−1``, ``0`` and ``+1``.

    Raises:
        ValueError: unknown ``method``, or a complex or boolean ``x``.

    Examples:
        >>> import torch
        >>> majority_vote(torch.tensor([0.3, -2.0, 0.0]))  # one rank: its own signs
        tensor([ 1., -1.,  0.])
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
        return ternary_signs(x, out_dtype)
    if method == "int8":
        votes = ternary_signs(x.reshape(-1), torch.int8 if n <= 127 else torch.int32)
        wait_work(
            dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=group, async_op=True),
            "majority vote all-reduce",
            group,
            device=x.device,  # used by kernels next, not read on the host
        )
        stats.record_collective(name, "all_reduce", nbytes=votes.nbytes, world_size=n)
        return ternary_signs(votes, out_dtype).reshape(x.shape)

    # packed: five votes per byte, padded (with abstentions) to a multiple of 5·N entries
    # so the bytes split evenly
    numel = x.numel()
    chunk = -(-numel // (VOTES_PER_BYTE * n))
    packed = torch.full((chunk * n,), ABSTAIN, dtype=torch.uint8, device=x.device)
    packed[: -(-numel // VOTES_PER_BYTE)] = pack_votes(x)
    received = torch.empty_like(packed)
    wait_work(
        dist.all_to_all_single(received, packed, group=group, async_op=True),
        "majority vote all-to-all",
        group,
        device=x.device,  # used by kernels next, not read on the host
    )
    stats.record(
        name,
        collectives=1,
        payload_bytes=packed.nbytes,
        bytes_sent=(n - 1) * chunk,
        bytes_received=(n - 1) * chunk,
        calls=0,
    )
    # received[r] is rank r's chunk for the positions this rank votes on: sum the votes
    # per position over the ranks and pack their sign
    votes = unpack_votes(received, (n, chunk * VOTES_PER_BYTE), dtype=torch.int8)
    # a sum of n votes in {-1, 0, 1} fits int8 up to 127 ranks (a quarter of int32's bytes)
    mine = pack_votes(votes.sum(dim=0, dtype=torch.int8 if n <= 127 else torch.int32))
    del votes, received  # before the result's buffers: the vote's peak is the sum's
    result = torch.empty_like(packed)
    wait_work(
        all_gather_single(result, mine, group=group, async_op=True),
        "majority vote all-gather",
        group,
        device=x.device,  # used by kernels next, not read on the host
    )
    stats.record_collective(name, "all_gather", nbytes=mine.nbytes, world_size=n)
    return unpack_votes(result, x.shape, dtype=out_dtype)
