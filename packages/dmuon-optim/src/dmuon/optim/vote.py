"""The one point where an update rule talks to other ranks: Sign-Muon's majority vote.

A rule never knows which rank it runs on. Sign-Muon (Mishra, Trivedi, Kumar, arXiv
2605.16311) needs one collective in the middle of its chain: every rank takes the
sign of its own orthogonalised momentum and the ranks agree on the elementwise
majority,

    S = sign(Σ_r s_r),    s_r ∈ {−1, 0, +1}^{B×m×n}.

The rule receives that collective as a :class:`SignVote` — a callable from the
local signs to the voted signs — handed in by whoever runs the step. On one
process it is :func:`local_vote`, the identity. The distributed engine hands in a
vote built on ``dmuon.comm.majority_vote`` (packed or int8: the same ``sign(Σ_r s_r)``,
a zero abstaining and a tie giving ``0``, so a vote of one rank is its own signs); the
rule code is the same in both cases.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["SignVote", "local_vote"]


@runtime_checkable
class SignVote(Protocol):
    """A majority vote over ranks: ``signs`` → the elementwise majority sign.

    Contract:

    * ``signs`` is a stacked batch ``(B, m, n)`` with entries in ``{−1, 0, +1}``, in
      the dtype of the matrices (the rule casts nothing).
    * The result has the same shape, dtype and device, entries in ``{−1, 0, +1}``.
    * Every rank must call the vote for the same batches in the same order. The
      chain itself is deterministic given the batch; the caller (the distributed
      engine) makes the batches agree, e.g. by stepping every matrix on every rank.

    Examples:
        >>> import torch
        >>> from dmuon.optim import SignVote, local_vote
        >>> isinstance(local_vote, SignVote)  # any callable signs → signs qualifies
        True
        >>> def flip(signs: torch.Tensor) -> torch.Tensor:  # a (silly) vote of one's own
        ...     return -signs
        >>> flip(torch.tensor([[1.0, -1.0]]))
        tensor([[-1.,  1.]])
    """

    def __call__(self, signs: torch.Tensor) -> torch.Tensor: ...


def local_vote(signs: torch.Tensor) -> torch.Tensor:
    """The vote of a single process: its own signs.

    Examples:
        >>> import torch
        >>> s = torch.tensor([[1.0, -1.0], [0.0, 1.0]])
        >>> local_vote(s) is s
        True
    """
    return signs
