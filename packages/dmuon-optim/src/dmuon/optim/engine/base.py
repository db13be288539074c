"""Where the optimizer and its engines meet: the :class:`Stepper` protocol, the
:class:`Engine` base class of the execution modes, and the ``single`` mode.

An engine drives a :class:`Stepper` (what :class:`~dmuon.optim.DMuon` implements):
it asks "step these same-shape matrices" (:meth:`Stepper.step_matrices`) and "step
these scalar parameters" (:meth:`Stepper.step_scalars`), and never imports the
optimizer class nor calls its private methods (DESIGN.md, "the optimizer and its
engines meet at a small public protocol"). An engine decides, for the optimizer it is bound to,

* which parameters this rank steps (:meth:`Engine.steps`) — the others keep
  placeholder state, so state dicts have the same keys on every rank;
* how the step is cut into pipeline groups (:meth:`Engine.step_groups`,
  :meth:`Engine.group_of`): one group for ``single``, one per layer otherwise;
* how a step runs (:meth:`Engine.step`): which collectives bring gradients in
  and results out, around the rule calls the optimizer makes on its buckets.

The rule never knows which mode runs it (DESIGN.md: same rules, same results).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, default_stats
from dmuon.comm.process_groups import group_size, twin_groups
from dmuon.kernels.dispatch import without_autotuning
from dmuon.optim.engine.params import EngineParam, collect_params, frozen_params, is_dtensor
from dmuon.optim.engine.placements import placement_of_param
from dmuon.optim.engine.report import StepReport
from dmuon.optim.engine.split_presence import PresenceGroups, agree_split_presence, presence_groups
from dmuon.optim.engine.tensor_split import settle_pending_grad, settle_split_grads, split_of
from dmuon.optim.matrix_split import MatrixSplit
from dmuon.optim.vote import SignVote

__all__ = ["Engine", "SingleEngine", "Stepper", "local_norm_tensors"]


class Stepper(Protocol):
    """What an engine needs from the optimizer it drives; :class:`~dmuon.optim.DMuon` is one.

    Attributes:
        param_groups: the optimizer's parameter groups (each with its ``"rule"``).
        sign_vote: the collective Sign-Muon's chain calls mid-step; an engine that
            votes across ranks (``sign`` mode) sets it when it binds.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, StepReport
        >>> w = torch.nn.Parameter(torch.ones(4, 4))
        >>> opt = DMuon([w])  # a Stepper
        >>> opt.is_scalar(opt.param_groups[0])
        False
        >>> w.grad = torch.ones(4, 4)
        >>> report = StepReport("single", 0, 1)
        >>> opt.step_matrices(0, None, report)  # what SingleEngine.step asks
        >>> report.matrices
        1
    """

    param_groups: list[dict[str, Any]]
    sign_vote: SignVote

    def is_scalar(self, group: Mapping[str, Any]) -> bool:
        """Whether ``group`` is stepped by a scalar optimizer (AdamW/Lion), not a matrix rule."""
        ...

    def step_matrices(
        self,
        index: int,
        key: str | None,
        report: StepReport,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
        sink: Any = None,
    ) -> None:
        """Run group ``index``'s rule on its same-shape batches of pipeline group ``key``.

        ``grads`` replaces ``p.grad`` (``sharded``/``sign`` modes); ``sink`` receives the
        updates instead of the parameters (``sharded``: they travel back to the shards).
        """
        ...

    def step_scalars(
        self, group: Mapping[str, Any], params: list[torch.Tensor] | None = None
    ) -> None:
        """Step ``params`` of scalar ``group`` (default: all its parameters with a gradient)."""
        ...


class Engine:
    """Base class of the execution modes (see the module docstring).

    Attributes:
        mode: the mode's name.
        rank: this rank in the engine's ranks (HSDP: ``i·S + j``).
        world_size: the number of those ranks.
        params: the optimizer's trainable parameters, named and layered.
        stats: where the engine's collectives count their bytes (the planned modes
            take it as an argument; here :func:`dmuon.comm.default_stats`): among them the
            pending sums of tensor-parallel gradients this base class carries out.
    """

    mode = "single"

    def __init__(self) -> None:
        self.stats: CommStats = default_stats()
        self.rank = 0
        self.world_size = 1
        self.params: list[EngineParam] = []
        self._by_param: dict[int, EngineParam] = {}
        self._frozen: list[tuple[str, torch.Tensor]] = []
        self._dtensors: list[EngineParam] = []  # whose gradients settle_split_grads lays out
        self._whole: frozenset[int] = frozenset()  # ids of the replicated-whole DTensor matrices
        self._presence: PresenceGroups | None = None  # split_presence(), made at first use
        self._missing: dict[str, str] = {}  # missing_gradients(): the last presence count's

    def bind(self, stepper: Stepper) -> None:
        """Learn the optimizer's parameters (called once, after its groups exist).

        A parameter frozen then (``requires_grad=False``) is left out of the plan: the
        distributed engines refuse a step in which it holds a gradient (:meth:`thawed`).
        """
        self.params = collect_params(stepper.param_groups)
        self._by_param = {id(e.param): e for e in self.params}
        self._frozen = frozen_params(stepper.param_groups)
        self._dtensors = [e for e in self.params if is_dtensor(e.param)]
        self._presence = None
        self._whole = frozenset(
            id(e.param)
            for e in self._dtensors
            if e.matrix and placement_of_param(e).replicated_whole
        )

    def repeats_orthogonalization(self) -> bool:
        """Whether several ranks compute the same orthogonalisation, each on its own, and
        must hold bitwise-equal results (replicas of one weight). Then :meth:`products`
        keeps the per-process autotuner out of the step. False by default: a matrix
        orthogonalised once, by its owner, reaches the other ranks by a collective."""
        return False

    def products(self) -> contextlib.AbstractContextManager[None]:
        """The context :func:`~dmuon.optim.stepping.run_step` runs :meth:`step` in:
        :func:`dmuon.kernels.dispatch.without_autotuning` where
        :meth:`repeats_orthogonalization`, else nothing.

        ``backend="auto"`` times its candidates in each process, and two ranks may pick
        different products (and Triton different tiles) for the same shape: their results
        differ by rounding, and replicas that must stay equal drift apart. Agreeing on the
        choice would take a collective inside the chain, which a rank with an empty batch
        never reaches; the torch products need none and are the same on every rank."""
        if self.repeats_orthogonalization():
            return without_autotuning()
        return contextlib.nullcontext()

    def info(self, p: torch.Tensor) -> EngineParam | None:
        """The engine's view of ``p`` (``None`` for a frozen parameter)."""
        return self._by_param.get(id(p))

    def steps(self, p: torch.Tensor) -> bool:
        """Whether this rank runs the update of ``p`` (and holds its full state)."""
        return True

    def step_groups(self) -> list[str | None]:
        """Pipeline groups, in the order the step processes them."""
        return [None]

    def split_of(self, p: torch.Tensor) -> MatrixSplit | None:
        """How ``p`` is split when this engine steps it on its tensor-parallel shards
        (:mod:`dmuon.optim.matrix_split`); ``None``: it is stepped whole."""
        return None

    def on_shard(self, p: torch.Tensor) -> bool:
        """Whether this engine steps ``p`` on this rank's local part of it (a DTensor's
        ``to_local()``) rather than whole: a matrix split over a tensor-parallel group
        (:meth:`split_of`), or a stack whose experts are split over a mesh dimension
        (each rank steps its own, whole), or a replicated-whole DTensor matrix
        (:meth:`replicated_whole`), whose local part is the whole matrix."""
        return self.split_of(p) is not None or self.replicated_whole(p)

    def replicated_whole(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a DTensor matrix with ``Replicate()`` on every mesh dimension
        (:attr:`~dmuon.optim.engine.placements.MatrixPlacement.replicated_whole`): the rule
        steps its local tensor, the whole matrix, as it steps a plain one — DTensor
        arithmetic on it would dispatch every op of the chain through DTensor, and the
        buckets batch plain tensors."""
        return id(p) in self._whole

    def group_of(self, p: torch.Tensor) -> str | None:
        """The pipeline group of ``p``."""
        return None

    def expert_owner(self, p: torch.Tensor) -> tuple[int, dist.ProcessGroup] | None:
        """``(rank in the group, group)`` of the rank that alone holds the state of expert
        stack ``p`` among the ranks holding the same experts (owner mode on a ``dp × ep``
        mesh: :mod:`~dmuon.optim.engine.expert_replicas`); ``None``: no such owner."""
        return None

    def step(self, stepper: Stepper, report: StepReport) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_timeout(self, seconds: float | None) -> None:
        """Seconds every wait of this engine outside ``DMuon.step`` may take (owner mode:
        the forward's wait for published weights); inside a step ``DMuon`` bounds them."""

    def set_step_number(self, number: int) -> None:
        """The number of the step about to run (named in the errors of later waits)."""

    def begin_step(self) -> None:
        """Issue what every rank issues before the step's own collectives (owner mode:
        launch the reductions not launched yet), so guards may add collectives after it:
        here, lay every DTensor matrix's gradient out as its parameter
        (:meth:`settle_dtensor_grads`)."""
        self.settle_dtensor_grads()

    def planning_groups(self) -> list[dist.ProcessGroup | None]:
        """The groups this mode plans owners over, where a gradient missing on some ranks
        counts as zero (here: none)."""
        return []

    def split_presence(self) -> PresenceGroups:
        """The tensor-parallel groups whose ranks must agree on which DTensor parameters
        hold a gradient (:func:`~dmuon.optim.engine.split_presence.presence_groups`, made
        at first use, without a collective)."""
        if self._presence is None:
            self._presence = presence_groups(self._dtensors, self.planning_groups())
        return self._presence

    def settle_dtensor_grads(self) -> None:
        """Agree on the DTensor gradients' presence over their tensor-parallel groups
        (:func:`~dmuon.optim.engine.split_presence.agree_split_presence`, before the
        groups' first collective), drop on every rank of its group a gradient some of its
        ranks do not hold (:meth:`missing_gradients`: the step's agreement then refuses
        the step everywhere), and lay each one left out as its parameter
        (:func:`~dmuon.optim.engine.tensor_split.settle_split_grads`)."""
        if not self._dtensors:
            return
        found = agree_split_presence(self.split_presence(), self.stats)
        if found:
            # dropped on every rank of the group: no collective of theirs (a pending sum
            # here, the norm's, the step's) can pair up wrongly after this; the record
            # stays for the step's agreement, which refuses the step on every rank
            for e in self._dtensors:
                if e.name in found:
                    e.param.grad = None
            self._missing.update(found)
        settle_split_grads(self._dtensors, self.stats)

    def missing_gradients(self) -> dict[str, str]:
        """The DTensor parameters :meth:`settle_dtensor_grads` found with a gradient on some
        ranks of their tensor-parallel group only since the last step's agreement (their
        gradients then dropped on every rank of it): name → description as errors give it
        (:func:`~dmuon.optim.engine.split_presence.agree_split_presence`). The step's
        agreement reads it once (and it is emptied) and refuses the step on every rank
        when any rank found one; :meth:`discard_grads` empties it too."""
        found, self._missing = self._missing, {}
        return found

    def begin_step_agreeing(
        self, slots: Callable[[frozenset[int]], torch.Tensor]
    ) -> torch.Tensor | None:
        """:meth:`begin_step`, carrying the step's agreement in its own first collective
        where it has one (:func:`~dmuon.optim.engine.guards.agree_step`).

        ``slots(vouched)`` gives this rank's agreement slots on the host (the engine moves
        them where its group takes them, :func:`~dmuon.comm.flags.flag_device`), read
        just before that collective (``vouched``: the ids of the parameters whose local
        gradient its non-finite check need not read, because the begin sets it to
        ``None`` or the engine has proven it finite); the result is them summed over
        :meth:`guard_groups`. ``None``: nothing carried (here: no collective to carry
        them in), the guards sum them themselves.
        """
        self.begin_step()
        return None

    def skip_step(self) -> None:
        """Finish this step's communication without stepping (every rank skips alike)."""

    def discard_grads(self) -> None:
        """Drop the gradients of a step that will not be taken (``DMuon.zero_grad``): what
        the backward launched is finished, the next backward starts a new step. Every
        rank calls it alike (owner mode communicates, as :meth:`skip_step`)."""
        self._missing = {}

    def thawed(self) -> list[str]:
        """The parameters of the groups that did not require a gradient when the
        optimizer was built but hold one now (see :meth:`bind`).

        A distributed engine planned without them (owners, buckets, the dedication's
        hooks): nothing would average their gradients or step them alike on every rank.
        ``DMuon.step`` refuses such a step on every rank. ``single`` mode takes them as
        they come (``[]``).
        """
        return [name for name, p in self._frozen if p.grad is not None]

    def settle(self) -> None:
        """Wait until every parameter :meth:`replicated_params` lists holds this step's
        value (owner mode: the dense layers' publications)."""

    def agreement_groups(self) -> list[dist.ProcessGroup | None]:
        """The process groups whose ranks must agree on a skip or a checksum (none alone)."""
        return []

    def guard_groups(self) -> list[dist.ProcessGroup | None]:
        """The groups the guards' flags and checksums are summed over: the agreement groups
        themselves, or (modes whose group the training framework also uses) their twins."""
        return self.agreement_groups()

    def replicated_params(self) -> list[EngineParam]:
        """Parameters every rank holds whole and identical after a step."""
        return [e for e in self.params if not is_dtensor(e.param)]

    def prepare_grads(self) -> None:
        """Make every gradient this rank holds final (owner mode: finish the reductions;
        here: lay DTensor gradients out as their parameters, so that the norms count this
        rank's shards, :meth:`settle_dtensor_grads`)."""
        self.settle_dtensor_grads()

    def changed_gradients(self) -> list[str]:
        """Parameters whose gradient this rank changed after the engine had taken it for a
        collective (owner mode: reduced to its owner during backward); the step's
        agreement raises :class:`~dmuon.optim.engine.GradientChangedError` on them."""
        return []

    def stale_gradients(self) -> list[str]:
        """Parameters whose gradient is still the averaged one the last step left on this
        rank, added to by this step's backward or stepped again without a ``zero_grad()``
        (owner mode: only the owner held it, so the others' gradients would be averaged
        with it as if it were the owner's own); the step's agreement raises
        :class:`~dmuon.optim.engine.StaleGradientError` on them. Here: none (every rank
        holds its own gradient, which one process would add to alike)."""
        return []

    def norm_tensors(self) -> tuple[list[torch.Tensor], list[dist.ProcessGroup | None]]:
        """Gradients for the global norm, each element counted on exactly one rank, and the
        groups to sum the per-rank partial norms over."""
        return [e.param.grad for e in self.params if e.param.grad is not None], []

    def norm_parts(
        self,
    ) -> tuple[list[torch.Tensor], list[float], list[dist.ProcessGroup | None]]:
        """:meth:`norm_tensors` with, for each tensor, the number of ranks that count a copy
        of it (its ``‖·‖ᵖ`` is divided by that number before the sum): 1 wherever
        :meth:`norm_tensors` counts every element on one rank."""
        tensors, groups = self.norm_tensors()
        return tensors, [1.0] * len(tensors), groups

    def local_grads(self) -> list[torch.Tensor]:
        """Every gradient this rank holds (what clipping scales)."""
        return [e.param.grad for e in self.params if e.param.grad is not None]

    def check_loaded_description(self, saved: Mapping[str, Any]) -> None:
        """Look at the ``"distributed"`` entry (:meth:`describe` of the saving engine) of a
        state dict about to be loaded: raise, before anything changes, or warn. Nothing
        by default."""

    def describe(self) -> dict[str, Any]:
        """Plain facts for the optimizer's state dict."""
        return {"mode": self.mode, "world_size": self.world_size, "rank": self.rank}


class SingleEngine(Engine):
    """Everything on this process: the optimizer as it is without a process group.

    Also the right engine when every rank deliberately does all the work on the
    same averaged gradients (DDP's ``vanilla distributed Muon`` baseline), and for
    tensor parallelism: a matrix split over a mesh dimension is stepped on its shards,
    each rank of the group its own, with the tensor-parallel Gram Newton–Schulz
    (:mod:`~dmuon.optim.engine.tensor_split`).
    """

    mode = "single"

    def __init__(self) -> None:
        super().__init__()
        self._guards: list[dist.ProcessGroup | None] = []

    def thawed(self) -> list[str]:
        return []  # stepped from the groups as they are, like torch's optimizers

    def bind(self, stepper: Stepper) -> None:
        """Learn the parameters; with DTensor matrices on several ranks, make the twin of
        the world the guards agree over (:meth:`agreement_groups`)."""
        super().bind(stepper)
        if self.agreement_groups() and not self._guards:
            # the training loop uses the world group too: the guards' flags go over a twin
            self._guards = twin_groups([None])

    def agreement_groups(self) -> list[dist.ProcessGroup | None]:
        """The world, when DTensor matrices (tensor- or expert-parallel) are stepped on
        several ranks: a NaN on one rank then skips (or raises) on every rank, so none
        enters a Gram all-reduce alone or steps weights the others do not. Nothing
        otherwise: each rank's step is its own, as in one process."""
        shared = group_size(None) > 1 and any(e.matrix and is_dtensor(e.param) for e in self.params)
        return [None] if shared else []

    def guard_groups(self) -> list[dist.ProcessGroup | None]:
        return self._guards

    def split_of(self, p: torch.Tensor) -> MatrixSplit | None:
        """A tensor-parallel matrix is stepped on its shards (:mod:`.tensor_split`)."""
        info = self.info(p)
        return split_of(p, info.name if info is not None else "", self.stats)

    def on_shard(self, p: torch.Tensor) -> bool:
        """A tensor-parallel matrix, an expert stack split over its expert dimension, over
        one mesh dimension or several (:attr:`~dmuon.optim.engine.placements.
        MatrixPlacement.expert_split`, :attr:`~dmuon.optim.engine.placements.
        MatrixPlacement.whole_experts`: each rank steps the experts it holds, as one batch,
        with no collective), and a matrix
        replicated whole (each rank steps its copy, the gradient's pending sums carried out
        first by :meth:`begin_step`)."""
        info = self.info(p)
        if info is None or not is_dtensor(p):
            return self.split_of(p) is not None
        pl = placement_of_param(info)
        return pl.tensor_split or pl.expert_split or pl.whole_experts or pl.replicated_whole

    def norm_parts(
        self,
    ) -> tuple[list[torch.Tensor], list[float], list[dist.ProcessGroup | None]]:
        """With DTensor gradients on several ranks (tensor- or expert-parallel matrices,
        FSDP2 rows), every rank counts its local shards and its plain gradients, each
        divided by the number of ranks that hold the same values — a plain gradient is
        the same on every rank (``single`` mode's contract), a shard on every replica
        of its mesh's ``Replicate()`` dimensions and on each copy of its mesh in the
        world — and one all-reduce over the world sums them. Without DTensors each
        rank computes the norm of what it holds alone, as one process does."""
        grads = [e.param.grad for e in self.params if e.param.grad is not None]
        world = group_size(None)
        if world == 1 or not any(is_dtensor(g) for g in grads):
            return grads, [1.0] * len(grads), []
        out: list[torch.Tensor] = []
        copies: list[float] = []
        for e in self.params:
            g = e.param.grad
            if g is None:
                continue
            if is_dtensor(g):
                # the sum stays in p.grad (marked for zero_grad): the step sums nothing again
                g = settle_pending_grad(e.param, g, e.name, self.stats)
                mesh = g.device_mesh  # type: ignore[attr-defined]
                replicas = math.prod(
                    mesh.size(d)
                    for d, pl in enumerate(g.placements)  # type: ignore[attr-defined]
                    if pl.is_replicate()
                )
                out.append(g.to_local())  # type: ignore[attr-defined]
                copies.append(world / mesh.size() * replicas)
            else:
                out.append(g)
                copies.append(float(world))
        return out, copies, [None]

    def repeats_orthogonalization(self) -> bool:
        """On several ranks, every rank repeats the whole step (DDP's averaged gradients,
        the same on every rank; a replicated or split matrix over a mesh): the replicas
        must stay bitwise equal, so ``backend="auto"`` takes the torch products, which
        need no timing and no collective (:meth:`Engine.products`). With one process,
        the autotuner chooses."""
        return group_size(None) > 1

    def step(self, stepper: Stepper, report: StepReport) -> None:
        for index, group in enumerate(stepper.param_groups):
            if stepper.is_scalar(group):
                with report.phase("scalar"):
                    stepper.step_scalars(group)
            else:
                stepper.step_matrices(index, None, report)
        report.groups = 1


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (``(0, 1)`` without distributed)."""
    n = group_size(group)
    if n == 1:
        return 0, 1
    return dist.get_rank(group), n


def local_norm_tensors(
    params: Iterable[EngineParam], stats: CommStats | None = None
) -> list[torch.Tensor]:
    """Local parts of DTensor gradients counted once: the shard on the first replica
    (pending sums, ``Partial``, carried out first and left in ``p.grad`` for the step:
    :func:`~dmuon.optim.engine.tensor_split.settle_pending_grad`, counted in ``stats``)."""
    out: list[torch.Tensor] = []
    for e in params:
        g = e.param.grad
        if g is None:
            continue
        if is_dtensor(g):
            g = settle_pending_grad(e.param, g, e.name, stats)
            from torch.distributed.tensor import Replicate

            mesh = g.device_mesh  # type: ignore[attr-defined]
            coords = mesh.get_coordinate() or []
            first = all(
                coords[d] == 0
                for d, pl in enumerate(g.placements)  # type: ignore[attr-defined]
                if isinstance(pl, Replicate)
            )
            if first:
                out.append(g.to_local())  # type: ignore[attr-defined]
        else:
            out.append(g)
    return out
