"""The pieces every update rule is made of: state specs, the step context, the chain runner.

An update rule is a short chain of transforms (DESIGN.md, "the update rule as a
chain of transforms", in the spirit of Optax). A transform maps the tensor that
flows down the chain — a stacked batch ``X`` of ``B`` same-shape matrices
``(B, m, n)`` — to the next one:

    X_{k+1} = T_k(X_k; state_k, hyperparameters, context)

Rules of the game, which let the distributed engine run the same chains unchanged:

* A transform owns the state buffers it declares (:class:`StateSpec`) and updates
  them in place; it reads nothing else but its input, the context and the
  hyperparameters of the group.
* It never modifies its input tensor in place (it may return it, or a view of its
  own state, unchanged).
* It never knows which rank it runs on; the only collective (Sign-Muon's vote)
  comes in through :attr:`StepContext.vote`.
* Shape factors (``adjust_lr``, MuonBP's block/full scales) are not multiplied
  into the tensor but into :attr:`StepContext.scale`; the apply step folds them
  into the learning rate, ``W ← W·(1 − lr·wd) − lr·scale·X_final``, which saves a
  pass over the update.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from dmuon.comm import tensor_parallel_path
from dmuon.kernels import default_compute_dtype, orthogonalize, tp_gram_newton_schulz
from dmuon.optim.hyperparameters import COMPUTE_DTYPES, REQUIRED, Option, boolean
from dmuon.optim.matrix_split import MatrixSplit
from dmuon.optim.vote import SignVote, local_vote

__all__ = [
    "COMPUTE_DTYPES",
    "SWITCH",
    "StateSpec",
    "StepContext",
    "Transform",
    "resolve_compute_dtype",
    "run_chain",
]


def resolve_compute_dtype(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` → ``torch.bfloat16``; ``None`` stays ``None`` (per-device default)."""
    return None if name is None else COMPUTE_DTYPES[name]


@dataclass(frozen=True)
class StateSpec:
    """A state buffer a transform owns, per matrix.

    Attributes:
        name: key in the optimizer state (unique within a rule).
        kind: ``"matrix"`` — one value per entry, shape ``(m, n)`` like the matrix;
            ``"row"`` — one value per row (output neuron), shape ``(m,)``.
        squares: a running mean of squares (a second moment). Kept in fp32 for fp16
            parameters unless ``state_dtype`` says otherwise
            (:func:`~dmuon.optim.state_precision.state_dtype_of`): fp16 squares of
            gradient-sized values underflow (``(1 − β₂)·g²`` is 0 below ``g ≈ 1e-3``),
            as AdamW's and Lion's fp32 state for fp16 parameters avoids too.
    """

    name: str
    kind: Literal["matrix", "row"]
    squares: bool = False

    def batch_shape(self, batch: int, m: int, n: int) -> tuple[int, ...]:
        """Shape of the stacked buffer for ``batch`` matrices of shape ``m × n``."""
        return (batch, m, n) if self.kind == "matrix" else (batch, m)


@dataclass
class StepContext:
    """What a transform may read besides its input and its state.

    Attributes:
        grad: the stacked gradient ``G`` of this step, ``(B, m, n)`` (read-only).
        hp: the hyperparameters of the group (plain values).
        step: 1-based count of updates of these matrices, this one included.
        vote: the sign vote (identity on one process).
        scale: multiplier the apply step puts on the final tensor; transforms
            multiply into it.
        split: how each matrix is split over a tensor-parallel group when ``X`` holds
            this rank's shards (``None``: whole matrices). Only transforms whose
            :attr:`Transform.splits` is true run then.
    """

    grad: torch.Tensor
    hp: Mapping[str, Any]
    step: int = 1
    vote: SignVote = local_vote
    scale: float = 1.0
    split: MatrixSplit | None = None

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """``(m, n)`` of the whole matrix: the split's, else the last two dims of ``grad``."""
        if self.split is not None:
            return self.split.shape
        return int(self.grad.shape[-2]), int(self.grad.shape[-1])

    def orthogonalize(self, X: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """Polar factor of each matrix of ``X`` with the group's Newton–Schulz settings.

        On a split matrix (:attr:`split`), ``X`` holds this rank's shards and the
        result is this rank's shards of the whole matrix's polar factor, by the path
        :func:`dmuon.comm.tensor_parallel_path` prices cheaper for the whole shape
        (every rank of the group computes the same choice): the Gram path,
        :func:`dmuon.kernels.tp_gram_newton_schulz` (the Gram iteration whatever
        ``ns_method`` says: it is the one that needs only the small Gram matrix summed
        over the group), or the gather path, when the unsplit side is the long one:
        one all-gather of the shards, ``ns_method`` on the whole matrix on every rank
        of the group, each keeping its shard.
        """
        hp = self.hp
        steps = hp["ns_steps"] if steps is None else steps
        dtype = resolve_compute_dtype(hp["ns_compute_dtype"])
        if self.split is not None and self._gathers(X, hp["ns_method"], steps):
            assert self.split.gather is not None
            whole = orthogonalize(
                self.split.gather(X),
                method=hp["ns_method"],
                coefficients=hp["ns_coefficients"],
                steps=steps,
                compute_dtype=dtype,
            )
            return whole.narrow(self.split.dim, self.split.offset, X.shape[self.split.dim])
        if self.split is not None:
            return tp_gram_newton_schulz(
                X,
                split_dim=self.split.dim,
                reduce=self.split.reduce,
                coefficients=hp["ns_coefficients"],
                steps=steps,
                compute_dtype=dtype,
            )
        return orthogonalize(
            X,
            method=hp["ns_method"],
            coefficients=hp["ns_coefficients"],
            steps=steps,
            compute_dtype=dtype,
        )

    def _gathers(self, X: torch.Tensor, method: str, steps: int) -> bool:
        """Whether a split batch takes the gather path: the group key ``tp_path``, or with
        ``"auto"`` :func:`dmuon.comm.tensor_parallel_path` on the whole shape (the same
        answer on every rank of the group), each path priced in the bytes it sends: the
        Gram matrices in the Newton–Schulz compute dtype, the shards in ``X``'s dtype."""
        split = self.split
        if split is None or split.gather is None or split.world_size < 2:
            return False
        path = self.hp.get("tp_path", "auto")
        if path != "auto":
            return bool(path == "gather")
        m, n = split.shape
        batch = max(1, math.prod(X.shape[:-2]))  # the same on every rank, empty shards too
        # each path priced in what it sends: the Gram matrices in the compute dtype (as
        # tp_gram_newton_schulz resolves it), the gathered shards in X's, the chain's
        compute = resolve_compute_dtype(self.hp["ns_compute_dtype"])
        if compute is None:
            compute = default_compute_dtype(X.device, "gram")
        choice = tensor_parallel_path(
            m,
            n,
            split.dim,
            split.world_size,
            gram_element_size=compute.itemsize,
            gather_element_size=X.element_size(),
            batch=batch,
            method=method,
            steps=steps,
        )
        return choice.path == "gather"


SWITCH = Option(REQUIRED, boolean, "run the transforms of the chain that name it (when_option=)")
"""The declaration of every ``when_option`` switch: one :class:`Option`, so that one switch
may turn on several links of a chain."""


@dataclass(frozen=True)
class Transform(ABC):
    """One link of an update rule's chain: a frozen dataclass with an :meth:`apply` hook.

    A transform subclasses this, implements :meth:`apply` and, when it owns state,
    :meth:`state_specs`. Calling the transform runs :meth:`apply`, unless
    ``when_option`` names a boolean hyperparameter that is false in this group:
    then ``X`` passes through unchanged and the transform's state is not touched.
    Any transform can be made optional that way, e.g. Sign-Muon's local polar step
    ``Orthogonalize(when_option="local_polar")`` or AdaMuon's
    ``Sign(when_option="sign")``.

    Attributes:
        when_option: name of a boolean hyperparameter of the group that switches
            the transform on (``None``: always on). Keyword-only.
        hyperparameters: class-level: every group hyperparameter :meth:`apply` reads
            from ``ctx.hp``, name → :class:`~dmuon.optim.hyperparameters.Option`
            (default, check, meaning), declared as the state is; a common matrix key
            (``momentum``, ``ns_steps``, …) is declared with its entry of
            :data:`~dmuon.optim.hyperparameters.MATRIX_KEYS`. A
            :class:`~dmuon.optim.Rule` derives its options from its chain's
            declarations (:meth:`hyperparameter_specs`).
        collective: class-level: ``True`` for a transform that communicates across
            ranks in the middle of the chain (Sign-Muon's vote, through
            :attr:`StepContext.vote`); the engine asks the rule
            (:attr:`~dmuon.optim.Rule.needs_collective`), never the rule's name.
        splits: class-level: ``True`` for a transform that computes on this rank's
            shard of a tensor-parallel matrix exactly what it computes on the whole
            (:mod:`dmuon.optim.matrix_split`): an elementwise map, or one that reaches
            the whole matrix only through :meth:`StepContext.orthogonalize` and
            :attr:`StepContext.matrix_shape`. Row or column statistics, norms and
            selections of the whole matrix need the group and say ``False``.

    Examples:
        >>> import torch
        >>> from dataclasses import dataclass
        >>> from dmuon.optim.transforms import StepContext, Transform
        >>> @dataclass(frozen=True)
        ... class Double(Transform):
        ...     def apply(self, X, state, ctx):
        ...         return 2 * X
        >>> X = torch.ones(1, 1, 2)
        >>> Double()(X, {}, StepContext(grad=X, hp={})).tolist()
        [[[2.0, 2.0]]]
        >>> Double(when_option="double")(X, {}, StepContext(grad=X, hp={"double": False})).tolist()
        [[[1.0, 1.0]]]
    """

    when_option: str | None = field(default=None, kw_only=True)
    hyperparameters: ClassVar[Mapping[str, Option]] = {}
    collective: ClassVar[bool] = False
    splits: ClassVar[bool] = False

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The buffers this transform owns (none unless a subclass says so)."""
        return ()

    def hyperparameter_specs(self) -> dict[str, Option]:
        """The hyperparameters this transform reads: :attr:`hyperparameters` and, where
        set, its ``when_option`` switch (a boolean with no default of its own: the rule
        that chains the transform gives it one)."""
        specs = dict(self.hyperparameters)
        if self.when_option is not None:
            specs[self.when_option] = SWITCH
        return specs

    def read_keys(self) -> tuple[str, ...]:
        """The names of :meth:`hyperparameter_specs`, in order."""
        return tuple(self.hyperparameter_specs())

    def __call__(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        """Map ``X`` ``(B, m, n)`` to the next tensor of the chain (``X`` itself when off)."""
        option = self.when_option
        if option is not None:
            if option not in ctx.hp:
                raise KeyError(
                    f"{type(self).__name__} runs when the hyperparameter {option!r} is true, "
                    f"but the group has no {option!r}; give the rule that option"
                )
            if not ctx.hp[option]:
                return X
        return self.apply(X, state, ctx)

    @abstractmethod
    def apply(
        self, X: torch.Tensor, state: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> torch.Tensor:
        """The transform itself: ``X`` ``(B, m, n)`` → the next tensor of the chain."""


def run_chain(
    chain: Sequence[Transform],
    G: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    ctx: StepContext,
) -> torch.Tensor:
    """Run the transforms of ``chain`` in order, starting from the gradient ``G``."""
    X = G
    for transform in chain:
        X = transform(X, state, ctx)
    return X
