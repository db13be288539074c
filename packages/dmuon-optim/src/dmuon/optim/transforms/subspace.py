"""NuMuon: a step along the top-k singular directions of the momentum."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, choice, integer, real
from dmuon.optim.transforms.base import StepContext, Transform

__all__ = ["RANK_SCHEDULES", "TopKPolar", "rank_fraction_at", "sketch_matrix"]

RANK_SCHEDULES = ("constant", "linear", "cosine")


def rank_fraction_at(hp: Mapping[str, object], step: int) -> float:
    """Relative rank ``r(t)`` of the schedule at 1-based ``step``.

    ``"constant"``: ``r = rank_fraction``. ``"linear"`` / ``"cosine"``: from
    ``rank_start`` at step 1 to ``rank_fraction`` at step ``rank_steps + 1``, then
    constant.

    Examples:
        >>> hp = dict(rank_schedule="linear", rank_start=1.0, rank_fraction=0.5, rank_steps=10)
        >>> rank_fraction_at(hp, 1), rank_fraction_at(hp, 6), rank_fraction_at(hp, 100)
        (1.0, 0.75, 0.5)
    """
    end = float(hp["rank_fraction"])  # type: ignore[arg-type]
    schedule = hp["rank_schedule"]
    if schedule == "constant":
        return end
    start = float(hp["rank_start"])  # type: ignore[arg-type]
    progress = min(1.0, (step - 1) / max(1, int(hp["rank_steps"])))  # type: ignore[call-overload]
    if schedule == "linear":
        return start + (end - start) * progress
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sketch_matrix(n: int, width: int, seed: int, step: int) -> torch.Tensor:
    """The Gaussian test matrix ``Ω`` (``n × width``, float64, CPU) of a step.

    It depends only on ``(n, width, seed, step)`` — not on which matrices share the
    batch — so a batched step equals the per-matrix step, and a restored
    checkpoint (which restores ``step``) replays the same sketches.
    """
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    return torch.randn(n, width, generator=gen, dtype=torch.float64)


@dataclass(frozen=True)
class TopKPolar(Transform):
    """``X ← U_k V_kᵀ`` for the top-k singular triplets of ``X``, ``k = ⌈r(t)·min(m, n)⌉``.

    The top-k subspace comes from randomised subspace iteration (Halko, Martinsson,
    Tropp 2011, Alg. 4.4) with ``l = min(k + oversample, min(m, n))`` columns and
    ``power_iters`` re-orthonormalised power steps:

        Y = X Ω;   repeat q times: Y = X (Xᵀ Q(Y));   Q = Q(Y);   B = Qᵀ X = Ũ Σ Vᵀ
        U_k = Q Ũ[:, :k],   V_k = V[:, :k]

    ``U_k V_kᵀ`` is the linear minimisation oracle of the Ky-Fan-k (for k = 1, the
    nuclear) norm ball; ``k = min(m, n)`` is Muon's exact polar factor. Directions
    with a zero singular value are dropped, so a zero matrix stays zero. Runs in
    fp32 (fp64 for fp64 input). Source: Dolatabadi et al., *NuMuon:
    Nuclear-Norm-Constrained Muon*, arXiv 2603.03597 (which uses block Krylov;
    subspace iteration is the simpler member of the same family).

    Hyperparameters: ``rank_fraction``, ``rank_schedule``, ``rank_start``,
    ``rank_steps``, ``power_iters``, ``oversample``, ``seed``.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import TopKPolar, StepContext
        >>> hp = dict(rank_fraction=1.0, rank_schedule="constant", power_iters=1,
        ...           oversample=4, seed=0)
        >>> X = torch.randn(2, 6, 9, dtype=torch.float64)
        >>> O = TopKPolar()(X, {}, StepContext(grad=X, hp=hp))
        >>> U, _, Vh = torch.linalg.svd(X, full_matrices=False)
        >>> torch.allclose(O, U @ Vh)
        True
    """

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "rank_fraction": Option(
            0.25, real(0.0, 1.0, lo_open=True), "relative rank r (the final one)"
        ),
        "rank_schedule": Option("constant", choice(RANK_SCHEDULES), "rank schedule"),
        "rank_start": Option(1.0, real(0.0, 1.0, lo_open=True), "relative rank at step 1"),
        "rank_steps": Option(1000, integer(1), "steps from rank_start to rank_fraction"),
        "power_iters": Option(2, integer(0), "power iterations of the range finder"),
        "oversample": Option(8, integer(0), "extra sketch columns"),
        "seed": Option(0, integer(0), "seed of the Gaussian sketches"),
    }

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        hp = ctx.hp
        m, n = X.shape[-2], X.shape[-1]
        full = min(m, n)
        k = max(1, min(full, math.ceil(rank_fraction_at(hp, ctx.step) * full)))
        width = min(full, k + int(hp["oversample"]))
        work = torch.float64 if X.dtype == torch.float64 else torch.float32
        # The factors returned do not depend on X's scale, but A @ Ω and the QR's norms
        # overflow for entries near the dtype's max (a saturated momentum): shift each
        # matrix's exponent by a power of two, which is exact, to an ∞-norm in [1/2, 1).
        A = X.to(work)
        _, exponent = torch.frexp(A.abs().amax(dim=(-2, -1), keepdim=True))
        A = torch.ldexp(A, -exponent)
        omega = sketch_matrix(n, width, int(hp["seed"]), ctx.step).to(work).to(X.device)
        Y = A @ omega
        for _ in range(int(hp["power_iters"])):
            Q = torch.linalg.qr(Y).Q
            Y = A @ torch.linalg.qr(A.mT @ Q).Q
        Q = torch.linalg.qr(Y).Q
        Ub, S, Vh = torch.linalg.svd(Q.mT @ A, full_matrices=False)
        tol = S[..., :1] * (torch.finfo(work).eps * max(m, n))
        keep = (S[..., :k] > tol).to(work)
        out = (Q @ Ub[..., :k]) @ (Vh[..., :k, :] * keep.unsqueeze(-1))
        return out.to(X.dtype)
