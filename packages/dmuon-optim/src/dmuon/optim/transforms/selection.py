"""Dion2/Dion3: orthogonalise only the top-k rows (or columns), with error feedback."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

import torch

from dmuon.optim.hyperparameters import Option, choice, matrix_keys, real
from dmuon.optim.transforms.base import StateSpec, StepContext, Transform, run_chain
from dmuon.optim.transforms.momentum import saturate_

__all__ = ["ErrorFeedbackSelect", "selected_count"]


def selected_count(fraction: float, size: int) -> int:
    """``k = ⌈fraction · size⌉``, at least 1 and at most ``size``, with ``fraction`` taken
    as the decimal it prints as (``0.07 · 100`` is 7, not the binary product's
    ``7.000000000000001`` rounded up to 8).

    Examples:
        >>> selected_count(0.07, 100), selected_count(0.25, 10), selected_count(1e-9, 10)
        (7, 3, 1)
    """
    return max(1, min(size, math.ceil(Fraction(str(float(fraction))) * size)))


@dataclass(frozen=True)
class ErrorFeedbackSelect(Transform):
    """Dion2's step: accumulate, pick the top-k slices by L1 norm, decay them, orthogonalise them.

    For each matrix of the batch:

        M ← clamp(M + G, ±max)                     (no decay of the whole buffer;
                                                    saturating, as in Momentum)
        S = the k = ⌈α·size⌉ rows (or columns) of M with the largest L1 norm
        U = M[S];   M[S] ← μ·M[S]                  (error feedback: the rest stays)
        O = inner(U)                               (orthogonalisation, NorMuon's …)
        X = 0 everywhere except X[S] = O

    ``select_dim`` chooses the slices: ``"rows"``, ``"cols"`` or ``"auto"`` (the
    shorter side, so that a selected slice is updated with the magnitude a full
    Muon step would give it). Selected slices keep their original order. Row-kind
    state of the inner transforms (NorMuon's ``v``) is narrowed to the selected
    rows and written back; it requires ``"rows"``. Sources: Ahn, Amsel, Langford,
    *Dion2*, arXiv 2512.16928; microsoft/dion ``dion2.py`` and ``nordion2.py``
    (Dion3 = Dion2's selection + NorMuon's normalisation).

    Hyperparameters: ``fraction`` (α ∈ (0, 1]), ``momentum`` (μ, the error-feedback
    decay, Dion2's ``ef_decay``), ``select_dim`` (declared only when no inner
    transform keeps row-kind state; with one, as in Dion3, the slices are rows).
    State: ``momentum_buffer`` (``matrix``) plus the inner transforms' state.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import ErrorFeedbackSelect, StepContext
        >>> G = torch.tensor([[[1.0, 1.0], [5.0, 5.0], [2.0, 2.0]]])
        >>> st = {"momentum_buffer": torch.zeros(1, 3, 2)}
        >>> hp = {"fraction": 0.34, "momentum": 0.5, "select_dim": "rows"}
        >>> ErrorFeedbackSelect()(G, st, StepContext(grad=G, hp=hp)).tolist()  # rows 1, 2
        [[[0.0, 0.0], [5.0, 5.0], [2.0, 2.0]]]
        >>> st["momentum_buffer"].tolist()
        [[[1.0, 1.0], [2.5, 2.5], [1.0, 1.0]]]
    """

    inner: Sequence[Transform] = field(default_factory=tuple)

    def state_specs(self) -> tuple[StateSpec, ...]:
        own = (StateSpec("momentum_buffer", "matrix"),)
        return own + tuple(s for t in self.inner for s in t.state_specs())

    hyperparameters: ClassVar[Mapping[str, Option]] = {
        **matrix_keys("momentum"),
        "fraction": Option(0.25, real(0.0, 1.0, lo_open=True), "fraction of rows/columns selected"),
    }

    def hyperparameter_specs(self) -> dict[str, Option]:
        """Its own keys, ``select_dim`` unless an inner transform keeps row-kind state
        (then the slices are rows: Dion3), and the inner transforms' keys."""
        specs = super().hyperparameter_specs()
        if not any(s.kind == "row" for t in self.inner for s in t.state_specs()):
            specs["select_dim"] = Option(
                "auto", choice(("auto", "rows", "cols")), "slices to select (auto = shorter)"
            )
        for t in self.inner:
            specs.update(t.hyperparameter_specs())
        return specs

    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        mu = float(ctx.hp["momentum"])
        M = state["momentum_buffer"]
        saturate_(M.add_(X))  # finite for every finite gradient, see Momentum
        m, n = M.shape[-2], M.shape[-1]
        dim = ctx.hp.get("select_dim", "rows")
        cols = dim == "cols" or (dim == "auto" and n < m)
        inner_specs = [s for t in self.inner for s in t.state_specs()]
        if cols and any(s.kind == "row" for s in inner_specs):
            raise ValueError("row-kind state (NorMuon's v) needs select_dim='rows'")
        Mw = M.mT if cols else M  # slices are the rows of Mw
        k = selected_count(float(ctx.hp["fraction"]), Mw.shape[-2])
        # L1 norms summed in fp32 at least: an fp16 row of finite entries sums past
        # 65504 to inf, and topk would break the tie by position
        norms = Mw.abs().sum(dim=-1, dtype=torch.promote_types(Mw.dtype, torch.float32))
        idx = norms.topk(k, dim=-1).indices.sort(dim=-1).values  # (B, k)
        idx_full = idx.unsqueeze(-1).expand(-1, -1, Mw.shape[-1])
        U = Mw.gather(-2, idx_full)
        Mw.scatter_(-2, idx_full, U * mu)
        sub_state = {}
        for s in inner_specs:
            buf = state[s.name]
            if s.kind == "row":
                sub_state[s.name] = buf.gather(-1, idx)
            else:
                sub_state[s.name] = (buf.mT if cols else buf).gather(-2, idx_full)
        O = run_chain(self.inner, U, sub_state, ctx)
        for s in inner_specs:
            buf = state[s.name]
            if s.kind == "row":
                buf.scatter_(-1, idx, sub_state[s.name])
            else:
                (buf.mT if cols else buf).scatter_(-2, idx_full, sub_state[s.name])
        out = torch.zeros_like(M)
        (out.mT if cols else out).scatter_(-2, idx_full, O.to(out.dtype))
        return out
