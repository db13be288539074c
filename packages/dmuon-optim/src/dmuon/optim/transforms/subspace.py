"""NuMuon: a step along the top-k singular directions of the momentum."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, choice, integer, real
from dmuon.optim.transforms.base import StepContext, Transform
from dmuon.optim.transforms.selection import selected_count

__all__ = ["RANK_SCHEDULES", "TopKPolar", "rank_fraction_at", "sketch_matrix", "sketch_seed"]

RANK_SCHEDULES = ("constant", "linear", "cosine")

POWER_ITERS_MAX = 100
"""The most power iterations the range finder may take. Two to four make the sketch's
range accurate to the leading singular values (Halko, Martinsson & Tropp, 2011, §4.5);
``power_iters=10**9`` ran two QR factorisations that many times, a step that never
ended."""


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


def sketch_seed(seed: int, step: int, n: int, width: int) -> int:
    """A 63-bit generator seed from ``(seed, step, n, width)`` (a fixed polynomial hash)."""
    h = 0
    for part in (seed, step, n, width):
        h = (h * 1_000_003 + int(part)) % (1 << 63)
    return h


def sketch_matrix(
    n: int,
    width: int,
    seed: int,
    step: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The Gaussian test matrix ``Ω`` (``n × width``) of a step, drawn on ``device``.

    It depends only on ``(n, width, seed, step)``, the device type and ``dtype`` — not
    on which matrices share the batch — so a batched step equals the per-matrix step,
    and a restored checkpoint (which restores ``step``) replays the same sketches.
    It is drawn by a generator of ``device`` (no host-side random numbers and no copy
    to the device each step); CPU and CUDA generators are different algorithms, so a
    run on a CPU and the same run on a GPU draw different sketches (both Gaussian).
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    gen = torch.Generator(device=device).manual_seed(sketch_seed(seed, step, n, width))
    return torch.randn(n, width, generator=gen, dtype=dtype, device=device)


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
    fp32 (fp64 for fp64 input). ``Ω`` is drawn on the matrix's device
    (:func:`sketch_matrix`); the small factorisation is an eigendecomposition of the
    ``l × l`` Gram matrix ``BBᵀ`` in float64 (an SVD of ``B`` for fp64 input).
    Source: Dolatabadi et al., *NuMuon: Nuclear-Norm-Constrained Muon*, arXiv
    2603.03597 (which uses block Krylov; subspace iteration is the simpler member of
    the same family).

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
        "power_iters": Option(
            2,
            integer(0, POWER_ITERS_MAX),
            f"power iterations of the range finder, 0 to {POWER_ITERS_MAX}",
        ),
        "oversample": Option(8, integer(0), "extra sketch columns"),
        "seed": Option(0, integer(0), "seed of the Gaussian sketches"),
    }

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        hp = ctx.hp
        m, n = X.shape[-2], X.shape[-1]
        full = min(m, n)
        k = selected_count(rank_fraction_at(hp, ctx.step), full)
        width = min(full, k + int(hp["oversample"]))
        work = torch.float64 if X.dtype == torch.float64 else torch.float32
        # The factors returned do not depend on X's scale, but A @ Ω and the QR's norms
        # overflow for entries near the dtype's max (a saturated momentum): shift each
        # matrix's exponent by a power of two, which is exact, to an ∞-norm in [1/2, 1).
        A = X.to(work)
        _, exponent = torch.frexp(A.abs().amax(dim=(-2, -1), keepdim=True))
        A = torch.ldexp(A, -exponent)
        omega = sketch_matrix(n, width, int(hp["seed"]), ctx.step, X.device, work)
        Y = A @ omega
        for _ in range(int(hp["power_iters"])):
            Q = torch.linalg.qr(Y).Q
            Y = A @ torch.linalg.qr(A.mT @ Q).Q
        Q = torch.linalg.qr(Y).Q
        out = _top_k_of_range(Q, Q.mT @ A, k, max(m, n))
        return out.to(X.dtype)


def _top_k_of_range(Q: torch.Tensor, C: torch.Tensor, k: int, big: int) -> torch.Tensor:
    """``U_k V_kᵀ`` of ``Q C`` (``Q`` orthonormal ``m × l``, ``C = QᵀA`` ``l × n``), dropping
    directions with ``σ ≤ σ_1·ε·max(m, n)`` (a zero matrix gives zero).

    fp64: the SVD of ``C``. Otherwise without the SVD of a wide matrix (slow on GPUs):
    the eigendecomposition of the small Gram matrix ``C Cᵀ = Ũ Σ² Ũᵀ`` in float64, then

        V_k = Cᵀ Ũ_k Σ_k^{-1},    U_k V_kᵀ = Q · (Ũ_k Σ_k^{-1} Ũ_kᵀ) · C.

    Squaring costs precision only for σ below ``√ε₆₄·σ_1 ≈ 1.5e-8·σ_1``; in fp32 every
    kept σ is above ``ε₃₂·σ_1·max(m, n) ≥ 1.2e-7·σ_1``, where the float64 eigenvectors
    give ``V_k`` to ``ε₆₄·σ_1²/σ_k² ≤ 2e-2·ε₃₂`` — below fp32's rounding.
    """
    work = C.dtype
    if work == torch.float64:
        Ub, S, Vh = torch.linalg.svd(C, full_matrices=False)
        tol = S[..., :1] * (torch.finfo(work).eps * big)
        keep = (S[..., :k] > tol).to(work)
        return (Q @ Ub[..., :k]) @ (Vh[..., :k, :] * keep.unsqueeze(-1))
    C64 = C.double()
    lam, Ub = torch.linalg.eigh(C64 @ C64.mT)  # ascending
    lam, Ub = lam.flip(-1)[..., :k].clamp_min(0.0), Ub.flip(-1)[..., :k]
    sv = lam.sqrt()
    tol = sv[..., :1] * (torch.finfo(work).eps * big)
    kept = sv > tol
    inv = torch.where(kept, 1.0 / torch.where(kept, sv, torch.ones_like(sv)), 0.0)
    P = (Ub * inv.unsqueeze(-2)) @ Ub.mT
    return (Q @ P.to(work)) @ C
