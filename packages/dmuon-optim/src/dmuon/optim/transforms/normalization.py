"""Second-moment normalisations around the orthogonalisation, and the spectral step size.

* :class:`RowNormalize` — NorMuon's per-neuron second moment *after* NS.
* :class:`ElementwiseNormalize` — AdaMuon's per-entry second moment *after* NS.
* :class:`AdamPrecondition` — Muon²'s Adam-style preconditioning *before* NS.
* :class:`SpectralNormalize` — divide each matrix by its spectral norm (Sign-Muon).

The two post-NS normalisations end with a Frobenius rescale, ``Ô ← Ô·‖O‖_F/‖Ô‖_F``:
the normalised update keeps exactly the Frobenius norm of the orthogonalised one,
so the learning-rate conventions (``adjust_lr``) mean the same as for Muon. With
``adjust_lr="match_rms_adamw"`` this is the papers' ``0.2·√(mn)/‖Ô‖_F`` rescale
(RMS 0.2) up to ``‖O‖_F`` vs ``√min(m, n)``, i.e. up to the Newton–Schulz band.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, real
from dmuon.optim.matrix_split import MatrixSplit
from dmuon.optim.state_precision import store_saturated
from dmuon.optim.transforms.base import StateSpec, StepContext, Transform

__all__ = [
    "AdamPrecondition",
    "ElementwiseNormalize",
    "RowNormalize",
    "SpectralNormalize",
    "match_frobenius",
]

# One declaration each, shared by NorMuon's, AdaMuon's, Muon²'s and Dion3's transforms: a
# rule that chains two of them reads one beta2 (Rule refuses two different ones).
_BETA2 = Option(0.95, real(0.0, 1.0, hi_open=True), "EMA decay of the second moment")
_EPS = Option(1e-8, real(0.0), "denominator guard")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself in fp32/fp64, else an fp32 copy: in fp16 an ε of 1e-8 rounds to 0 and
    squares of small entries underflow, which turned a zero or tiny gradient into 0/0."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def match_frobenius(
    Y: torch.Tensor, X: torch.Tensor, split: MatrixSplit | None = None
) -> torch.Tensor:
    """``Y·‖X‖_F/‖Y‖_F`` per matrix of the batch; a zero ``Y`` stays zero.

    On the shards of a split matrix (``split``), the norms are of the whole matrices:
    the shards' squared norms, summed over the group in one reduction.
    """
    if split is None:
        nx = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
        ny = torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True)
    else:
        squares = torch.stack([X.square().sum(dim=(-2, -1)), Y.square().sum(dim=(-2, -1))])
        squares = _summed(squares, split)
        nx, ny = (s.sqrt()[:, None, None] for s in squares)
    ratio = torch.where(ny > 0, nx / torch.where(ny > 0, ny, torch.ones_like(ny)), 0.0)
    return Y * ratio


def _summed(t: torch.Tensor, split: MatrixSplit) -> torch.Tensor:
    """``t`` summed over the ranks of ``split``'s group (a contiguous copy, reduced)."""
    t = t.contiguous()
    out = split.reduce(t, "sum")
    return t if out is None else out


@dataclass(frozen=True)
class RowNormalize(Transform):
    """NorMuon: ``v ← β₂v + (1−β₂)·mean_j(O∘O)``, ``Ô = O/(√v + ε)``, Frobenius rescale.

    ``v`` has one entry per row of each matrix — per output neuron of an
    ``nn.Linear`` weight ``(out, in)``, always dim −2, never decided by width vs
    height (the orientation bug modded-nanogpt fixed). Source: Li, Liu, Liang,
    Chen, Zhao, *NorMuon*, arXiv 2510.05491; microsoft/dion ``dion/normuon.py``.

    Hyperparameters: ``beta2``, ``eps``. State: ``row_second_moment`` (``row``).

    On the shards of a split matrix: split by rows, each rank's rows are whole and
    ``v`` is its rows'; split by columns, each row's sum of squares is summed over
    the group (divided by the whole width) and every rank keeps the same ``v``. The
    Frobenius rescale uses the whole matrix's norms (:func:`match_frobenius`).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import RowNormalize, StepContext
        >>> O = torch.randn(2, 4, 8)
        >>> state = {"row_second_moment": torch.zeros(2, 4)}
        >>> out = RowNormalize()(O, state, StepContext(grad=O, hp={"beta2": 0.95, "eps": 1e-8}))
        >>> torch.allclose(out.norm(dim=(-2, -1)), O.norm(dim=(-2, -1)))
        True
    """

    name: str = "row_second_moment"

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec(self.name, "row", squares=True),)

    hyperparameters: ClassVar[Mapping[str, Option]] = {"beta2": _BETA2, "eps": _EPS}
    splits: ClassVar[bool] = True  # rows' sums and the rescale's norms over the group

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        beta2, eps = float(ctx.hp["beta2"]), float(ctx.hp["eps"])
        v, Xw = state[self.name], _wide(X)
        vw = _wide(v)
        split = ctx.split
        if split is not None and split.dim == -1:  # a row's entries are on every rank
            row_mean = _summed(Xw.square().sum(dim=-1), split) / split.shape[1]
        else:
            row_mean = Xw.square().mean(dim=-1)
        store_saturated(v, vw.mul_(beta2).add_(row_mean, alpha=1.0 - beta2))
        denom = vw.sqrt().unsqueeze(-1) + eps
        Y = Xw / (_nonzero(denom) if eps == 0 else denom)
        return match_frobenius(Y, Xw, split).to(X.dtype)


def _nonzero(denom: torch.Tensor) -> torch.Tensor:
    """``denom`` with its zeros replaced by 1: a zero second moment (an entry or row whose
    every value so far was 0, so its numerator is 0 too) with ``ε = 0`` gives 0, not
    0/0 = NaN."""
    return torch.where(denom > 0, denom, torch.ones_like(denom))


@dataclass(frozen=True)
class ElementwiseNormalize(Transform):
    """AdaMuon: ``V ← β₂V + (1−β₂)·O∘O``, ``Ô = O/(√V + ε)``, Frobenius rescale.

    The second moment is of the *orthogonalised* direction, entry by entry, with no
    bias correction (the rescale cancels it). Source: Si, Zhang, Shen, *AdaMuon*,
    arXiv 2507.11005.

    Hyperparameters: ``beta2``, ``eps``. State: ``second_moment`` (``matrix``).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import ElementwiseNormalize, StepContext
        >>> O = torch.randn(1, 3, 5)
        >>> st = {"second_moment": torch.zeros(1, 3, 5)}
        >>> ElementwiseNormalize()(O, st, StepContext(grad=O, hp={"beta2": 0.9, "eps": 1e-8})).shape
        torch.Size([1, 3, 5])
    """

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec("second_moment", "matrix", squares=True),)

    hyperparameters: ClassVar[Mapping[str, Option]] = {"beta2": _BETA2, "eps": _EPS}
    splits: ClassVar[bool] = True  # elementwise, and the rescale's norms over the group

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        beta2, eps = float(ctx.hp["beta2"]), float(ctx.hp["eps"])
        V, Xw = state["second_moment"], _wide(X)
        Vw = _wide(V)
        store_saturated(V, Vw.mul_(beta2).addcmul_(Xw, Xw, value=1.0 - beta2))
        denom = Vw.sqrt() + eps
        Y = Xw / (_nonzero(denom) if eps == 0 else denom)
        return match_frobenius(Y, Xw, ctx.split).to(X.dtype)


@dataclass(frozen=True)
class AdamPrecondition(Transform):
    """Muon²: ``V ← β₂V + (1−β₂)·G∘G`` of the raw gradient, ``X ← X/√(V + ε)``.

    An Adam-style elementwise preconditioner applied to the momentum *before*
    Newton–Schulz, which leaves a better-conditioned spectrum (the paper reports
    40% fewer NS iterations). ``ε`` sits inside the root as in the reference
    (Liu et al., *Muon²*, arXiv 2604.09967); no bias correction, since the scale of
    ``X`` is removed by the normalisation in front of NS.

    Hyperparameters: ``beta2``, ``muon2_eps`` (ε inside the root: its own name, since
    NorMuon's, AdaMuon's and Dion3's ``eps`` sits outside it, 1e-8 against 1e-16).
    State: ``grad_second_moment`` (``matrix``).

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import AdamPrecondition, StepContext
        >>> G = torch.full((1, 2, 2), 2.0)
        >>> st = {"grad_second_moment": torch.zeros(1, 2, 2)}
        >>> ctx = StepContext(grad=G, hp={"beta2": 0.0, "muon2_eps": 0.0})
        >>> AdamPrecondition()(G, st, ctx)[0, 0, 0].item()  # 2 / sqrt(4)
        1.0
    """

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec("grad_second_moment", "matrix", squares=True),)

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        "beta2": _BETA2,
        "muon2_eps": Option(1e-16, real(0.0), "guard inside the root: X/√(V + ε)"),
    }
    splits: ClassVar[bool] = True  # elementwise

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        beta2, eps = float(ctx.hp["beta2"]), float(ctx.hp["muon2_eps"])
        G, V = _wide(ctx.grad), state["grad_second_moment"]
        Vw = _wide(V)
        # saturated at V's dtype's max: a finite gradient spike whose square overflows
        # leaves ±max, not an inf that would zero that entry's update for the rest of the
        # run (β₂·inf = inf) — in a bf16/fp16 state too, where fp32's max is inf
        store_saturated(V, Vw.mul_(beta2).addcmul_(G, G, value=1.0 - beta2))
        # 0/√(0 + ε) is 0 in fp32; a zero second moment with ε = 0 is guarded too
        Y = _wide(X) / _nonzero((Vw + eps).sqrt())
        return Y.to(X.dtype)


@dataclass(frozen=True)
class SpectralNormalize(Transform):
    """``X ← X/‖X‖₂`` per matrix (a zero matrix stays zero).

    Sign-Muon's "spectral-norm-normalised sign step". ``‖X‖₂ = √λ_max(X Xᵀ)`` on the
    small Gram matrix (wide orientation), in fp32 (fp64 for fp64 input), to a
    certified relative accuracy (:func:`inverse_spectral_norm`): a ±1 sign matrix has
    no spectral gap to speak of, so a fixed number of power-iteration steps would
    not be reliable.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import SpectralNormalize, StepContext
        >>> S = torch.ones(1, 2, 8)
        >>> SpectralNormalize()(S, {}, StepContext(grad=S, hp={}))[0].norm().item()
        1.0
    """

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        return X * inverse_spectral_norm(X)


SPECTRAL_NORM_METHODS = ("eigvalsh", "squaring")
"""Ways :func:`inverse_spectral_norm` finds ``λ_max`` of the Gram matrix."""

LAMBDA_MAX_METHOD: dict[str, str] = {"cpu": "eigvalsh"}
"""The method per device type (``"auto"``); others use ``"squaring"``. LAPACK's
symmetric eigenvalue solver is fast on a CPU (0.4 s for 2048 × 2048 on one thread,
where twelve squarings take 2.5 s); cuSOLVER's is slow on a GPU (22 ms per
2048 × 2048 matrix on an H200), where the squarings are plain GEMMs."""


def inverse_spectral_norm(X: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """``1/‖X_b‖₂`` for each matrix, shape ``(B, 1, 1)``, in ``X``'s dtype; 0 for a zero matrix.

    ``‖X‖₂² = λ_max(G)``, ``G = W Wᵀ``, ``W`` the wide orientation of ``X`` scaled by a
    power of two (exact) so that its largest entry is in ``[1/2, 1)``: no overflow of
    ``G`` for any finite ``X``. ``λ_max`` comes from :func:`lambda_max_by_squaring`
    (``method="squaring"``, matrix products only) or ``torch.linalg.eigvalsh``
    (``"eigvalsh"``); ``"auto"`` picks by device (:data:`LAMBDA_MAX_METHOD`).
    """
    if method == "auto":
        method = LAMBDA_MAX_METHOD.get(X.device.type, "squaring")
    if method not in SPECTRAL_NORM_METHODS:
        raise ValueError(f"method must be 'auto' or one of {SPECTRAL_NORM_METHODS}, got {method!r}")
    work = torch.float64 if X.dtype == torch.float64 else torch.float32
    W = X.to(work).reshape(-1, X.shape[-2], X.shape[-1])
    if W.shape[-2] > W.shape[-1]:
        W = W.mT
    _, exponent = torch.frexp(W.abs().amax(dim=(-2, -1), keepdim=True))
    W = torch.ldexp(W, -exponent)
    gram = W @ W.mT
    if method == "eigvalsh":
        lam = torch.linalg.eigvalsh(gram)[..., -1:].unsqueeze(-1)
    else:
        lam = lambda_max_by_squaring(gram)
    sigma = lam.clamp_min(0.0).sqrt()
    safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
    inv = torch.where(sigma > 0, torch.ldexp(1.0 / safe, -exponent), 0.0)
    return inv.to(X.dtype)


SQUARINGS_PER_CHECK = 4
"""Squarings between two convergence checks of :func:`lambda_max_by_squaring`: each check
reads a flag on the host, a synchronisation that stalls a GPU's queue (one per squaring
was ~12 per batched call of Sign-Muon's spectral normalisation, 3 now)."""


def lambda_max_by_squaring(G: torch.Tensor, max_squarings: int = 64) -> torch.Tensor:
    """The largest eigenvalue of each symmetric positive semi-definite ``G``, ``(B, 1, 1)``.

    Repeated squaring with trace normalisation, ``A_0 = G/tr G``,
    ``A_{k+1} = A_k²/tr(A_k²)`` (so ``tr A_k = 1`` and ``A_k = G^p/tr(G^p)``, ``p = 2^k``),
    brackets ``λ_max`` between two bounds that cost O(m²) each:

        L_k = tr(A_k G) = Σ_i λ_i^{p+1} / Σ_i λ_i^p ≤ λ_max ≤ tr(G^p)^{1/p} = U_k,
        U_0 = tr G,   U_{k+1} = U_k · tr(A_k²)^{1/(2p)}.

    ``L_k`` is a mean of the eigenvalues weighted by ``λ_i^p``, ``U_k`` at most
    ``r^{1/p}·λ_max`` with ``r`` the rank: both tend to ``λ_max`` whatever the gap
    (power iteration needs a gap; Lanczos a random start). It stops when
    ``U_k ≤ L_k(1 + 64ε)`` for every matrix (``ε`` of ``G``'s dtype), asked every
    :data:`SQUARINGS_PER_CHECK` squarings (each ask is a host synchronisation; a
    squaring past convergence only moves ``L_k`` closer to ``λ_max``), or after
    ``max_squarings``, and returns ``L_k``.
    Rounding in ``A_k`` only moves the weights of the mean, so ``L_k`` stays a mean
    of ``G``'s own eigenvalues. A zero ``G`` gives 0. Each squaring is one ``m × m``
    GEMM (Higham, *Functions of Matrices*, §4.9 on the trace bound of powers).
    """
    tr = torch.diagonal(G, dim1=-2, dim2=-1).sum(-1)[..., None, None]
    safe = torch.where(tr > 0, tr, torch.ones_like(tr))
    A = G / safe
    upper = tr.clone()
    lower = (A * G).sum(dim=(-2, -1), keepdim=True)
    tol = 64 * torch.finfo(G.dtype).eps
    p = 1.0
    for k in range(max_squarings):
        # a non-finite G (NaN momentum) has nothing to converge to: stop, return NaN
        if k % SQUARINGS_PER_CHECK == 0 and bool(
            ((upper <= lower * (1 + tol)) | ~torch.isfinite(lower)).all()
        ):
            break
        t = (A * A).sum(dim=(-2, -1), keepdim=True)  # tr(A²) = ‖A‖_F², A symmetric
        A = (A @ A) / torch.where(t > 0, t, torch.ones_like(t))
        upper = upper * torch.where(t > 0, t, torch.ones_like(t)).pow(1 / (2 * p))
        p *= 2
        lower = (A * G).sum(dim=(-2, -1), keepdim=True)
    return lower  # 0 for a zero G: A_0 = G/1 = 0
