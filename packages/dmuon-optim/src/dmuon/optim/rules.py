"""The update rules of the Muon family, each a short chain of transforms.

A rule is data: its chain, whether it reads the step count, and where it comes
from. Its hyperparameters are what its transforms declare (name, default, check),
so a rule only names a default of its own where its chain needs one. :meth:`Rule.update` is
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
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dmuon.optim.hyperparameters import MATRIX_KEYS, REQUIRED, Option
from dmuon.optim.matrix_split import MatrixSplit
from dmuon.optim.transforms import (
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
    """An update rule: a chain of transforms, and the hyperparameters the chain declares.

    Attributes:
        name: the ``rule=`` value (a group's ``"rule"`` key).
        chain: the transforms, in order.
        defaults: this rule's own default for a key its chain declares (Muon²'s
            ``eps``, AdaMuon's ``sign`` switch); checked like any value. A caller's
            value (``DMuon(**options)`` or a group's key) always wins over it. Not for
            the common matrix keys (:data:`MATRIX_KEYS`: ``lr``, ``momentum``, ...),
            whose default is the constructor's.
        uses_step: whether a transform reads the step count (the step runs matrices
            with different counts in separate batches).
        summary: one line.
        source: paper or code it follows.
        reconstruction: ``True`` where the source gives only an abstract and the
            equations are our documented reconstruction.
        options: derived, not passed: every key the chain declares
            (:meth:`Transform.hyperparameter_specs
            <dmuon.optim.transforms.Transform.hyperparameter_specs>`) beyond the common
            matrix keys, with ``defaults`` applied.

    Raises:
        ValueError: at definition, naming the rule, the transform and the key: a state
            name declared twice; a key declared twice with different defaults or checks;
            a key with no default (neither a common matrix key nor in ``defaults``);
            a ``defaults`` key the chain does not read, a common matrix key, or a bad
            value for it.

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
    defaults: Mapping[str, Any] = field(default_factory=dict)
    uses_step: bool = False
    summary: str = ""
    source: str = ""
    reconstruction: bool = False
    options: Mapping[str, Option] = field(init=False)

    def __post_init__(self) -> None:
        owners: dict[str, list[str]] = {}
        for t in self.chain:
            for spec in t.state_specs():
                owners.setdefault(spec.name, []).append(type(t).__name__)
        repeated = {n: who for n, who in sorted(owners.items()) if len(who) > 1}
        if repeated:
            listed = "; ".join(f"{n!r} by {', '.join(who)}" for n, who in repeated.items())
            raise ValueError(
                f"rule {self.name!r}: state name(s) declared by more than one transform of "
                f"its chain ({listed}); each buffer needs its own name"
            )
        object.__setattr__(self, "options", self._derive_options())

    def _derive_options(self) -> dict[str, Option]:
        """The chain's declared keys beyond :data:`MATRIX_KEYS`, ``defaults`` applied."""
        declared: dict[str, tuple[str, Option]] = {}
        for t in self.chain:
            who = type(t).__name__
            for key, opt in t.hyperparameter_specs().items():
                # a common key's one declaration is MATRIX_KEYS'; another key's, its first
                first, same = declared.setdefault(key, (who, MATRIX_KEYS.get(key, opt)))
                if opt != same:
                    other = "MATRIX_KEYS" if key in MATRIX_KEYS else first
                    if (opt.default, opt.doc) == (same.default, same.doc):
                        differ = (
                            f"the same default and meaning as {other}'s, but another Option "
                            "object (its check is another function)"
                        )
                    else:
                        differ = (
                            f"default {opt.default!r}: {opt.doc}) unlike {other} (default "
                            f"{same.default!r}: {same.doc}"
                        )
                    raise ValueError(
                        f"rule {self.name!r}: {who} declares hyperparameter {key!r} "
                        f"({differ}); a key is one Option, shared by every transform that "
                        "reads it: declare it once at module level and use that object in "
                        "each transform's hyperparameters"
                    )
        common = sorted(set(self.defaults) & set(MATRIX_KEYS))
        if common:
            raise ValueError(
                f"rule {self.name!r}: defaults for {common}, common matrix keys whose "
                "default is the DMuon constructor's (and the caller's value, its own): a "
                "rule cannot set them. Give the value to DMuon(...) or to the param group"
            )
        unread = sorted(set(self.defaults) - set(declared))
        if unread:
            raise ValueError(
                f"rule {self.name!r}: defaults for {unread}, which no transform of its chain "
                f"reads; its chain reads {sorted(declared)}"
            )
        options: dict[str, Option] = {}
        for key, (who, opt) in declared.items():
            if key in MATRIX_KEYS:
                continue  # a group value, filled from the DMuon constructor
            if key in self.defaults:
                try:
                    value = opt.check(self.defaults[key])
                except ValueError as e:
                    raise ValueError(f"rule {self.name!r}: default {key} {e}") from None
                opt = replace(opt, default=value)
            if opt.default is REQUIRED:
                raise ValueError(
                    f"rule {self.name!r}: {who} reads hyperparameter {key!r}, which has no "
                    "default and is not a common matrix key; give the rule one "
                    f"(Rule(..., defaults={{{key!r}: ...}}))"
                )
            options[key] = opt
        return options

    @property
    def reads(self) -> tuple[str, ...]:
        """Every group hyperparameter the chain reads (declared by its transforms), once."""
        return tuple(dict.fromkeys(k for t in self.chain for k in t.hyperparameter_specs()))

    @property
    def needs_collective(self) -> bool:
        """Whether a transform of the chain communicates across ranks mid-chain (Sign-Muon's
        vote): such a rule runs on every rank's own gradient, in ``sign`` mode only."""
        return any(t.collective for t in self.chain)

    @property
    def splits(self) -> bool:
        """Whether the rule steps this rank's shard of a tensor-parallel matrix exactly as it
        steps the whole (every link's :attr:`~dmuon.optim.transforms.Transform.splits`;
        :mod:`dmuon.optim.matrix_split`)."""
        return all(t.splits for t in self.chain)

    def unsplittable(self) -> tuple[str, ...]:
        """The links of the chain that need the whole matrix (what an error names)."""
        return tuple(dict.fromkeys(type(t).__name__ for t in self.chain if not t.splits))

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
        split: MatrixSplit | None = None,
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
            split: how each matrix is split over a tensor-parallel group when ``G``
                holds this rank's shards (:mod:`dmuon.optim.matrix_split`); only a rule
                whose :attr:`splits` is true takes one.

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
        if split is not None and not self.splits:
            raise ValueError(
                f"rule {self.name!r} cannot step a shard of a tensor-parallel matrix: "
                f"{', '.join(self.unsplittable())} need(s) the whole matrix"
            )
        ctx = StepContext(grad=G, hp=hp, step=step, vote=vote, split=split)
        U = run_chain(self.chain, G, state, ctx)
        return U, ctx.scale


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
            defaults={"sign": True},  # orthogonalise sign(M) (paper v2+) instead of M
            summary="NS of sign(M), elementwise second moment of the result, Frobenius rescale",
            source="Si, Zhang, Shen, AdaMuon, arXiv 2507.11005",
        ),
        Rule(
            "muon2",
            (Momentum(), AdamPrecondition(), Orthogonalize(), AdjustLR()),
            summary="Adam-style second-moment preconditioning before NS",
            source="Liu et al., Muon², arXiv 2604.09967",
        ),
        Rule(
            "mona",
            (Momentum(), GradDiffAcceleration(), Orthogonalize(), AdjustLR()),
            uses_step=True,
            summary="an EMA of gradient differences added before NS (reconstruction)",
            source="Li et al., MONA, arXiv 2605.26842 (abstract only); Adan, arXiv 2208.06677",
            reconstruction=True,
        ),
        Rule(
            "musec",
            (Momentum(), MomentumSpectralClip(), AdjustLR()),
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
            defaults={"local_polar": False},  # orthogonalise the voted signs again
            summary="sign of the polar factor, majority vote across ranks, spectral-norm step",
            source="Mishra, Trivedi, Kumar, Sign-Muon, arXiv 2605.16311 (abstract; "
            "normalisation reconstructed)",
            reconstruction=True,
        ),
        Rule(
            "dion2",
            (ErrorFeedbackSelect(inner=(Orthogonalize(),)), AdjustLR()),
            summary="orthogonalise the top-k rows/columns by L1 norm, error feedback on the rest",
            source="Ahn, Amsel, Langford, Dion2, arXiv 2512.16928; microsoft/dion dion2.py",
        ),
        Rule(
            "dion3",
            (ErrorFeedbackSelect(inner=(Orthogonalize(), RowNormalize())), AdjustLR()),
            summary="Dion2's row selection with NorMuon's normalisation (NorDion2)",
            source="microsoft/dion nordion2.py, dion3.py",
        ),
        Rule(
            "muonbp",
            (Momentum(), BlockPeriodicOrthogonalize()),
            uses_step=True,
            summary="blockwise orthogonalisation, the full matrix every P steps",
            source="Khaled et al., MuonBP, arXiv 2510.16981",
        ),
        Rule(
            "numuon",
            (Momentum(), TopKPolar(), AdjustLR()),
            uses_step=True,
            summary="step along the top-k singular directions (randomised subspace iteration)",
            source="Dolatabadi et al., NuMuon, arXiv 2603.03597",
        ),
        Rule(
            "scion",
            (Momentum(), Orthogonalize(), SpectralRadius()),
            summary="the spectral-norm LMO step ρ·√(fan_out/fan_in)·polar(momentum)",
            source="Pethick et al., Scion, arXiv 2502.07529 (hidden matrices)",
        ),
    )
}
"""Every update rule by name (the values of ``rule=`` and of a group's ``"rule"`` key):
``muon``, ``normuon``, ``adamuon``, ``muon2``, ``mona``, ``musec``, ``sign_muon``,
``dion2``, ``dion3``, ``muonbp``, ``numuon``, ``scion``. Each is a :class:`Rule`; the
Algorithms pages give their equations."""


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
