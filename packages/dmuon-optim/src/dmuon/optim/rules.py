"""The update rules of the Muon family, each a short chain of transforms.

A rule is data: its chain, its own hyperparameters (with defaults and checks),
whether it reads the step count, and where it comes from. :meth:`Rule.update` is
the pure, rank-agnostic function the optimizer — and later the distributed
engine, on each owner's batch — calls on a stacked batch of same-shape matrices:

    U, scale = rule.update(G, state, hp, step=t, vote=vote)
    W ← W·(1 − lr·wd) − lr·scale·U          (dmuon.optim.apply_update)

Momentum is in sum form everywhere (``M ← μM + G``, see
:class:`~dmuon.optim.transforms.Momentum`); each rule's page in the docs says what
that means for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dmuon.optim.hyperparameters import (
    MATRIX_KEYS,
    Option,
    boolean,
    choice,
    integer,
    optional,
    real,
)
from dmuon.optim.transforms import (
    RANK_SCHEDULES,
    AdamPrecondition,
    AdjustLR,
    BlockPeriodicOrthogonalize,
    ElementwiseNormalize,
    ErrorFeedbackSelect,
    GradDiffAcceleration,
    MajorityVote,
    Momentum,
    MomentumSpectralClip,
    Orthogonalize,
    RowNormalize,
    Sign,
    SpectralNormalize,
    SpectralRadius,
    StateSpec,
    StepContext,
    TopKPolar,
    Transform,
    run_chain,
)
from dmuon.optim.vote import SignVote, local_vote

__all__ = ["RULES", "Rule", "get_rule"]


@dataclass(frozen=True)
class Rule:
    """An update rule: a chain of transforms with its own hyperparameters.

    Attributes:
        name: the ``rule=`` / ``algorithm`` value.
        chain: the transforms, in order.
        options: the rule's own hyperparameters (beyond the common matrix keys).
        uses_step: whether a transform reads the step count (the step runs matrices
            with different counts in separate batches).
        summary: one line.
        source: paper or code it follows.
        reconstruction: ``True`` where the source gives only an abstract and the
            equations are our documented reconstruction.

    Examples:
        >>> from dmuon.optim import get_rule
        >>> rule = get_rule("normuon")
        >>> [type(t).__name__ for t in rule.chain]
        ['Momentum', 'Orthogonalize', 'RowNormalize', 'AdjustLR']
        >>> sorted(rule.options), rule.options["beta2"].default
        (['beta2', 'eps'], 0.95)
    """

    name: str
    chain: tuple[Transform, ...]
    options: Mapping[str, Option] = field(default_factory=dict)
    uses_step: bool = False
    summary: str = ""
    source: str = ""
    reconstruction: bool = False

    def __post_init__(self) -> None:
        names = [s.name for t in self.chain for s in t.state_specs()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"rule {self.name!r}: state name(s) {repeated} are declared by more than one "
                "transform of its chain; each buffer needs its own name"
            )
        missing = sorted(set(self.reads) - set(MATRIX_KEYS) - set(self.options))
        if missing:
            raise ValueError(
                f"rule {self.name!r}: its chain reads hyperparameter(s) {missing}, which are "
                "neither common matrix keys nor options of the rule; give the rule an Option "
                "(with its default and check) for each"
            )

    @property
    def reads(self) -> tuple[str, ...]:
        """Every group hyperparameter the chain reads (declared by its transforms), once."""
        return tuple(dict.fromkeys(k for t in self.chain for k in t.read_keys()))

    @property
    def needs_collective(self) -> bool:
        """Whether a transform of the chain communicates across ranks mid-chain (Sign-Muon's
        vote): such a rule runs on every rank's own gradient, in ``sign`` mode only."""
        return any(t.collective for t in self.chain)

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Every buffer of the chain, per matrix."""
        return tuple(s for t in self.chain for s in t.state_specs())

    def update(
        self,
        G: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        hp: Mapping[str, Any],
        *,
        step: int = 1,
        vote: SignVote = local_vote,
    ) -> tuple[torch.Tensor, float]:
        """Run the chain on a stacked batch; return the update and its scale.

        Args:
            G: gradients, ``(B, m, n)``, one matrix per entry of the batch.
            state: the rule's buffers, stacked the same way (``(B, m, n)`` or
                ``(B, m)``, see :meth:`state_specs`); updated in place.
            hp: the group's hyperparameters (common matrix keys and this rule's
                options).
            step: 1-based number of updates of these matrices, this one included.
            vote: Sign-Muon's majority vote (identity on one process).

        Returns:
            ``(U, scale)`` with ``W ← W·(1 − lr·wd) − lr·scale·U``.

        Examples:
            >>> import torch
            >>> from dmuon.optim import get_rule
            >>> rule = get_rule("muon")
            >>> G = torch.randn(4, 16, 64)
            >>> state = {"momentum_buffer": torch.zeros_like(G)}
            >>> hp = dict(momentum=0.95, nesterov=True, adjust_lr="match_rms_adamw",
            ...           ns_method="gram", ns_coefficients="polar_express", ns_steps=5,
            ...           ns_compute_dtype=None)
            >>> U, scale = rule.update(G, state, hp)
            >>> U.shape, round(scale, 3)
            (torch.Size([4, 16, 64]), 1.6)
        """
        ctx = StepContext(grad=G, hp=hp, step=step, vote=vote)
        U = run_chain(self.chain, G, state, ctx)
        return U, ctx.scale


_BETA2 = Option(0.95, real(0.0, 1.0, hi_open=True), "EMA decay of the second moment")
_EPS = Option(1e-8, real(0.0), "denominator guard")
_FRACTION = Option(0.25, real(0.0, 1.0, lo_open=True), "fraction of rows/columns selected")

RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule(
            "muon",
            (Momentum(), Orthogonalize(), AdjustLR()),
            summary="momentum, then its orthogonalised direction",
            source="K. Jordan, Muon (2024); Moonlight, arXiv 2502.16982; DMuon arXiv 2606.27153",
        ),
        Rule(
            "normuon",
            (Momentum(), Orthogonalize(), RowNormalize(), AdjustLR()),
            options={"beta2": _BETA2, "eps": _EPS},
            summary="Muon with a per-row second moment after NS and a Frobenius rescale",
            source="Li et al., NorMuon, arXiv 2510.05491; microsoft/dion normuon.py",
        ),
        Rule(
            "adamuon",
            (
                Momentum(),
                Sign(when_option="sign"),
                Orthogonalize(),
                ElementwiseNormalize(),
                AdjustLR(),
            ),
            options={
                "beta2": _BETA2,
                "eps": _EPS,
                "sign": Option(True, boolean, "orthogonalise sign(M) (paper v2+) instead of M"),
            },
            summary="NS of sign(M), elementwise second moment of the result, Frobenius rescale",
            source="Si, Zhang, Shen, AdaMuon, arXiv 2507.11005",
        ),
        Rule(
            "muon2",
            (Momentum(), AdamPrecondition(), Orthogonalize(), AdjustLR()),
            options={
                "beta2": _BETA2,
                "eps": Option(1e-16, real(0.0), "guard inside the root: X/√(V + ε)"),
            },
            summary="Adam-style second-moment preconditioning before NS",
            source="Liu et al., Muon², arXiv 2604.09967",
        ),
        Rule(
            "mona",
            (Momentum(), GradDiffAcceleration(), Orthogonalize(), AdjustLR()),
            options={
                "mona_beta": Option(
                    0.92, real(0.0, 1.0, hi_open=True), "EMA decay of gradient differences"
                ),
                "mona_gamma": Option(0.92, real(0.0), "weight of the acceleration term"),
            },
            uses_step=True,
            summary="an EMA of gradient differences added before NS (reconstruction)",
            source="Li et al., MONA, arXiv 2605.26842 (abstract only); Adan, arXiv 2208.06677",
            reconstruction=True,
        ),
        Rule(
            "musec",
            (Momentum(), MomentumSpectralClip(), AdjustLR()),
            options={
                "clip_mode": Option("hard", choice(("hard", "soft")), "hard or soft clipping"),
                "clip_tau": Option(1.0, real(0.0, lo_open=True), "clipping level τ"),
                "clip_steps": Option(None, optional(integer(1)), "inner iterations of the clip"),
            },
            summary="clip the momentum's singular values at τ instead of setting them to 1",
            source="reconstruction from MuCon (arXiv 2605.26459) and SPECTRA (arXiv 2603.14315)",
            reconstruction=True,
        ),
        Rule(
            "sign_muon",
            (
                Momentum(),
                Orthogonalize(),
                Sign(),
                MajorityVote(),
                Orthogonalize(when_option="local_polar"),
                SpectralNormalize(),
                AdjustLR(),
            ),
            options={
                "local_polar": Option(False, boolean, "orthogonalise the voted signs again"),
            },
            summary="sign of the polar factor, majority vote across ranks, spectral-norm step",
            source="Mishra, Trivedi, Kumar, Sign-Muon, arXiv 2605.16311 (abstract; "
            "normalisation reconstructed)",
            reconstruction=True,
        ),
        Rule(
            "dion2",
            (ErrorFeedbackSelect(inner=(Orthogonalize(),)), AdjustLR()),
            options={
                "fraction": _FRACTION,
                "select_dim": Option(
                    "auto", choice(("auto", "rows", "cols")), "slices to select (auto = shorter)"
                ),
            },
            summary="orthogonalise the top-k rows/columns by L1 norm, error feedback on the rest",
            source="Ahn, Amsel, Langford, Dion2, arXiv 2512.16928; microsoft/dion dion2.py",
        ),
        Rule(
            "dion3",
            (ErrorFeedbackSelect(inner=(Orthogonalize(), RowNormalize())), AdjustLR()),
            options={"fraction": _FRACTION, "beta2": _BETA2, "eps": _EPS},
            summary="Dion2's row selection with NorMuon's normalisation (NorDion2)",
            source="microsoft/dion nordion2.py, dion3.py",
        ),
        Rule(
            "muonbp",
            (Momentum(), BlockPeriodicOrthogonalize()),
            options={
                "period": Option(5, integer(1), "a full orthogonalisation every P steps"),
                "row_blocks": Option(2, integer(1), "blocks along the rows (shards)"),
                "col_blocks": Option(1, integer(1), "blocks along the columns"),
                "block_lr_scale": Option(1.0, real(0.0), "η_block / lr"),
                "full_lr_scale": Option(1.0, real(0.0), "η_full / lr"),
            },
            uses_step=True,
            summary="blockwise orthogonalisation, the full matrix every P steps",
            source="Khaled et al., MuonBP, arXiv 2510.16981",
        ),
        Rule(
            "numuon",
            (Momentum(), TopKPolar(), AdjustLR()),
            options={
                "rank_fraction": Option(
                    0.25, real(0.0, 1.0, lo_open=True), "relative rank r (the final one)"
                ),
                "rank_schedule": Option("constant", choice(RANK_SCHEDULES), "rank schedule"),
                "rank_start": Option(1.0, real(0.0, 1.0, lo_open=True), "relative rank at step 1"),
                "rank_steps": Option(1000, integer(1), "steps from rank_start to rank_fraction"),
                "power_iters": Option(2, integer(0), "power iterations of the range finder"),
                "oversample": Option(8, integer(0), "extra sketch columns"),
                "seed": Option(0, integer(0), "seed of the Gaussian sketches"),
            },
            uses_step=True,
            summary="step along the top-k singular directions (randomised subspace iteration)",
            source="Dolatabadi et al., NuMuon, arXiv 2603.03597",
        ),
        Rule(
            "scion",
            (Momentum(), Orthogonalize(), SpectralRadius()),
            options={
                "radius": Option(1.0, real(0.0, lo_open=True), "ρ, the spectral ball's radius"),
            },
            summary="the spectral-norm LMO step ρ·√(fan_out/fan_in)·polar(momentum)",
            source="Pethick et al., Scion, arXiv 2502.07529 (hidden matrices)",
        ),
    )
}
"""Every update rule by name (the ``rule=`` / ``algorithm`` values): ``muon``, ``normuon``,
``adamuon``, ``muon2``, ``mona``, ``musec``, ``sign_muon``, ``dion2``, ``dion3``, ``muonbp``,
``numuon``, ``scion``. Each is a :class:`Rule`; the Algorithms pages give their equations."""


def get_rule(name: str) -> Rule:
    """The rule called ``name``.

    Raises:
        ValueError: unknown name; the message lists the rules.

    Examples:
        >>> get_rule("normuon").options["beta2"].default
        0.95
    """
    try:
        return RULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown rule {name!r}; expected one of {sorted(RULES)}") from None
