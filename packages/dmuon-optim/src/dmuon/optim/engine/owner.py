"""``owner`` mode (DMuon): gradients reduced to owners, the owner steps, weights broadcast.

The communication is an :class:`~dmuon.optim.engine.OwnerExchange` that an
integration built and hooked into the model (``dmuon.integrations.fsdp.dedicate``
or ``dmuon.integrations.ddp.dedicate``). The step is a pipeline over layers in
forward order: wait for layer *i*'s reductions, run the rule on the matrices this
rank owns in it, start broadcasting them, go on to layer *i + 1* — so the first
layers' weights travel while the last layers are still being orthogonalised, and
the next forward only waits, layer by layer, for what it needs. Every publication
lands in the parameters' own storage, so the number of layers in flight costs no
memory.

Over a ``dp × tp`` mesh (:mod:`~dmuon.optim.engine.owner_split`) the exchange's
group is ``dp``: a tensor-parallel matrix is stepped by its owner's ``tp`` row, each
rank its shard, with the :class:`~dmuon.optim.matrix_split.MatrixSplit` that
:meth:`OwnerEngine.split_of` hands out — the same machinery as ``single`` and
``replicated`` mode (:mod:`~dmuon.optim.engine.tensor_split`).

An expert stack whose mesh spans exactly the exchange's group (a 1-D ``ep`` mesh over
the ranks ``ddp.dedicate`` plans on, or a ``dp × ep`` mesh over them:
:func:`~dmuon.optim.engine.expert_split.in_place_replicas`) is not dedicated: each rank
holds whole experts, with their whole gradients over ``ep`` once the expert dispatch's
backward has run, so it steps them where they live, as one batch — first in the step,
while the dense matrices' last reductions are still in flight. On a ``dp × ep`` mesh each
stack has one owner among the ``dp`` replicas of the same experts, which the gradient is
reduced to and which broadcasts the stepped experts back
(:mod:`~dmuon.optim.engine.expert_replicas`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dmuon.optim.engine.base import Engine, Stepper, local_norm_tensors
from dmuon.optim.engine.exchange import OwnerExchange, exchange_of
from dmuon.optim.engine.expert_replicas import ExpertReplicas
from dmuon.optim.engine.expert_split import expert_group_of, in_place_replicas
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.report import StepReport
from dmuon.optim.engine.tensor_split import settle_split_grads, split_of
from dmuon.optim.matrix_split import MatrixSplit, local_tensor
from dmuon.optim.rules import get_rule

__all__ = ["OwnerEngine"]


class OwnerEngine(Engine):
    """Run the owner step with ``exchange`` (see the module docstring)."""

    mode = "owner"

    def __init__(self, exchange: OwnerExchange) -> None:
        super().__init__()
        self.exchange = exchange
        self.stats = exchange.stats  # the dedication's: the tp sums count where its bytes do
        self.rank = exchange.rank
        self.world_size = exchange.world_size
        # Made by bind(), read by every step (one dictionary lookup per parameter, not a
        # scan of every parameter per layer): the dedicated parameters' ids, the layer
        # keys, and per layer the scalar parameters this rank steps in it, by group.
        self._dedicated_ids: frozenset[int] = frozenset()
        self._keys: list[str] = []
        self._scalars_by_layer: dict[str | None, list[tuple[int, list[torch.Tensor]]]] = {}
        self._matrix_groups: list[int] = []
        # per layer, the replicated-whole DTensor matrices this rank owns (settle_owned)
        self._whole_by_layer: dict[str, list[EngineParam]] = {}
        # the expert stacks whose mesh is the exchange's group, stepped where they live, and
        # per set of ranks holding the same experts (dp × ep), each stack's owner there
        self._in_place_ids: frozenset[int] = frozenset()
        self._replicas = ExpertReplicas([], self.stats)
        self._replicas_reduced = False

    def bind(self, stepper: Stepper) -> None:
        super().bind(stepper)
        ex = self.exchange
        for index, group in enumerate(stepper.param_groups):
            if not stepper.is_scalar(group) and get_rule(group["rule"]).needs_collective:
                raise ValueError(
                    f"param group {index} uses rule {group['rule']!r}, which votes across "
                    "ranks on each rank's local gradient; a dedication reduces the gradients to "
                    "their owners, so there would be nothing to vote on. Drop the dedication and "
                    "use mode='sign' (train without DDP), or pick another rule for owner mode"
                )
        ours: list[EngineParam] = []  # the parameters dedicated to this optimizer's exchange
        in_place: list[EngineParam] = []  # expert stacks whose mesh is the exchange's group
        # per set of ranks holding the same experts (dp × ep), the stacks they share
        replica_sets: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[EngineParam]]] = {}
        for e in self.params:
            owner = exchange_of(e.param)
            if owner is not None and owner is not ex:
                raise ValueError(
                    f"parameter {e.name!r} is dedicated to another dedication than the one "
                    "this optimizer was given; use one dedicate() per model"
                )
            dedicated = owner is ex
            if dedicated:
                ours.append(e)
            replicas = self._in_place_replicas(e) if e.matrix and not dedicated else None
            if replicas is not None:
                in_place.append(e)
                if len(replicas) > 1:
                    raise ValueError(
                        f"expert stack {e.name!r} is replicated over {len(replicas)} mesh "
                        "dimensions; owner mode gives each stack one owner among the replicas "
                        "of one ('dp' of a 'dp × ep' mesh): flatten them into one dimension"
                    )
                for g in replicas:
                    ranks = tuple(sorted(dist.get_process_group_ranks(g)))
                    replica_sets.setdefault(ranks, (g, []))[1].append(e)
            elif e.matrix and not dedicated:
                raise ValueError(
                    f"matrix parameter {e.name!r} is not dedicated: in owner mode every matrix "
                    "parameter is stepped by its owner. Dedicate it (the default predicate "
                    "of dedicate() takes the matrices of param_groups(model)) or put it in a "
                    "scalar group"
                )
            synced = dedicated or ex.name_of(e.param) is not None or self._sharded_over(e.param)
            if not synced and self.world_size > 1:
                raise ValueError(
                    f"parameter {e.name!r} is neither dedicated, nor all-reduced by the "
                    "dedication, nor sharded by FSDP2: nothing would average its gradient "
                    "across ranks. Pass it to fully_shard, or use dmuon.integrations.ddp."
                    "dedicate, which all-reduces the scalar parameters"
                )
        names = {ex.name_of(e.param) for e in ours}
        missing = [n for n in ex.names if n not in names]
        if missing:
            raise ValueError(
                f"dedicated parameter(s) {missing[:3]} are in no param group of this "
                "optimizer (or frozen); give the optimizer every dedicated parameter"
            )
        self._dedicated_ids = frozenset(id(e.param) for e in ours)
        self._in_place_ids = frozenset(id(e.param) for e in in_place)
        sets = ExpertReplicas(
            [replica_sets[k] for k in sorted(replica_sets)],
            self.stats,
            free_local_grads=ex.reduction.free_local_grads,
        )
        # their gradients summed into the owner as backward produces them: the replica sets
        # the reduction holds already when they are these stacks' (another optimizer's over
        # this dedication), else these
        self._replicas = ex.reduction.attach_experts(sets if sets.sets else None) or sets
        if self._replicas is sets:  # the first optimizer over these stacks: rank 0's start
            sets.synchronize()
        self._keys = ex.layer_keys()
        self._matrix_groups = [
            i for i, g in enumerate(stepper.param_groups) if not stepper.is_scalar(g)
        ]
        # None: the scalar parameters outside the dedication (FSDP2's), stepped last
        by_layer: dict[str | None, list[tuple[int, list[torch.Tensor]]]] = {}
        for index, group in enumerate(stepper.param_groups):
            if not stepper.is_scalar(group):
                continue
            mine: dict[str | None, list[torch.Tensor]] = {}
            for p in group["params"]:
                if self.steps(p):
                    mine.setdefault(self.group_of(p), []).append(p)
            for key, params in mine.items():
                by_layer.setdefault(key, []).append((index, params))
        self._scalars_by_layer = by_layer
        whole: dict[str, list[EngineParam]] = {}
        for e in ours:
            if self.replicated_whole(e.param) and self.steps(e.param):
                key = self.group_of(e.param)
                assert key is not None
                whole.setdefault(key, []).append(e)
        self._whole_by_layer = whole

    def _dedicated(self, p: torch.Tensor) -> bool:
        # the ids are collected by bind(), which the optimizer calls right after making
        # the engine; nothing asks before
        return id(p) in self._dedicated_ids

    def _in_place_replicas(self, e: EngineParam) -> list[dist.ProcessGroup] | None:
        """For an expert stack stepped where it lives (its mesh spans exactly the
        exchange's group: :func:`~dmuon.optim.engine.expert_split.in_place_replicas`), the
        groups of the ranks holding the same experts (none on a 1-D ``ep`` mesh, ``dp`` on
        a ``dp × ep`` mesh); ``None`` for any other parameter. Raises for an expert stack
        split otherwise (a mesh over other ranks, or beside ``tp`` or HSDP replicas)."""
        split = expert_group_of(e)
        if split is None:
            return None
        ex = self.exchange
        group = ex.group if ex.group is not None else dist.group.WORLD
        mesh_ranks = [int(r) for r in e.param.device_mesh.mesh.flatten().tolist()]  # type: ignore[attr-defined]
        mine = dist.get_process_group_ranks(group) if self.world_size > 1 else mesh_ranks
        if not ex.tensor_groups and ex.replicate_group is None:
            replicas = in_place_replicas(e.param, split[0], mine)
            if replicas is not None:
                return replicas
        raise ValueError(
            f"expert stack {e.name!r} is laid out over ranks {sorted(mesh_ranks)}, but the "
            f"dedication plans owners over ranks {sorted(mine)}"
            + (" beside tensor parallelism" if ex.tensor_groups else "")
            + (" with HSDP replicas" if ex.replicate_group is not None else "")
            + ": owner mode steps expert stacks where they live when their mesh spans the "
            "dedication's ranks exactly (a 1-D 'ep' mesh over the ranks of ddp.dedicate, or "
            "a 'dp × ep' mesh over them). Otherwise step them with DMuon(..., "
            "mode='replicated', process_group=mesh.get_group('dp')) without a dedication"
        )

    def _reduce_replicas(self, write: bool = True) -> None:
        """Once per step: each replicated expert stack's gradient summed into its owner
        among its replicas (:meth:`~dmuon.optim.engine.expert_replicas.ExpertReplicas.
        reduce`: the reductions backward did not launch, then the waits), before a norm,
        an unscale or the step reads it. ``write=False``: a skipped or dropped step's, only
        finished."""
        if not self._replicas_reduced and self._replicas.sets:
            self._replicas_reduced = True
            self._replicas.reduce(write=write)

    def _end_replicas(self) -> None:
        """After a step, a skipped or a dropped one: the next backward starts anew."""
        if self._replicas.sets:
            self._replicas.end_step()
        self._replicas_reduced = False

    def expert_owner(self, p: torch.Tensor) -> tuple[int, dist.ProcessGroup] | None:
        """``(rank in the group, group)`` of the replica that owns expert stack ``p`` (a
        ``dp × ep`` mesh: it alone holds the stack's state); ``None`` for any other
        parameter."""
        return self._replicas.owner_of(p)

    def _sharded_over(self, p: torch.Tensor) -> bool:
        """A DTensor whose mesh spans more of the dedication's ranks than this rank (FSDP2
        over ``dp`` synchronises it); a tensor-parallel DTensor over ``tp`` alone is not.

        The dedication's ranks are its group *and*, under HSDP, its replicate group: on an
        ``(R, 1)`` mesh the shard group is this rank alone, and FSDP2 averages the gradient
        over the replicate dimension only (it was refused as synchronised by nothing)."""
        if not is_dtensor(p):
            return False
        if self.world_size == 1:
            return True
        mesh = p.device_mesh  # type: ignore[attr-defined]
        ex = self.exchange
        group = ex.group if ex.group is not None else dist.group.WORLD
        mine = set(dist.get_process_group_ranks(group))
        if ex.replicate_group is not None:
            mine |= set(dist.get_process_group_ranks(ex.replicate_group))
        return any(
            len(set(dist.get_process_group_ranks(mesh.get_group(d))) & mine) > 1
            for d in range(mesh.ndim)
        )

    def split_of(self, p: torch.Tensor) -> MatrixSplit | None:
        """A dedicated tensor-parallel matrix is stepped on its shards by its owner's
        ``tp`` row (:mod:`~dmuon.optim.engine.owner_split`)."""
        if not self._dedicated(p) or not is_dtensor(p):
            return None
        name = self.exchange.name_of(p)
        return split_of(p, name or "", self.exchange.stats)

    def on_shard(self, p: torch.Tensor) -> bool:
        """A split matrix and a replicated-whole DTensor (:meth:`Engine.on_shard`), and an
        expert stack stepped where it lives: its local experts."""
        return id(p) in self._in_place_ids or super().on_shard(p)

    def steps(self, p: torch.Tensor) -> bool:
        if not self._dedicated(p):  # a replicated expert stack: its owner among the replicas
            return p not in self._replicas or self._replicas.owns(p)
        name = self.exchange.name_of(p)
        return name is not None and self.exchange.owner(name) == self.rank

    def step_groups(self) -> list[str | None]:
        return [*self.exchange.layer_keys(), None]

    def group_of(self, p: torch.Tensor) -> str | None:
        if not self._dedicated(p):
            return None
        name = self.exchange.name_of(p)
        assert name is not None
        return self.exchange.layer_of(name)

    def set_timeout(self, seconds: float | None) -> None:
        self.exchange.publication.timeout = seconds

    def set_step_number(self, number: int) -> None:
        self.exchange.publication.published_step = number

    def begin_step(self) -> None:
        self.exchange.reduction.flush()

    def begin_step_agreeing(
        self, slots: Callable[[frozenset[int]], torch.Tensor]
    ) -> torch.Tensor | None:
        """The flush's flag all-reduce carries the agreement
        (:meth:`~dmuon.optim.engine.reduction.Reduction.flush`): its groups are the
        agreement's (:meth:`agreement_groups`, over ``dp``). Not over ``dp × tp``: the
        agreement spans ``tp`` too, the presence flags are ``dp``'s alone (each ``tp`` rank
        has its own exchange), so there the two stay apart."""
        red = self.exchange.reduction
        if self.exchange.tensor_groups or not red.carries_agreement():
            red.flush()
            return None
        return red.flush(agreement=slots)

    def skip_step(self) -> None:
        ex = self.exchange
        ex.reduction.wait_all_reduced()  # drain the reductions every rank launched
        self._reduce_replicas(write=False)
        self._end_replicas()
        if ex.reshard_after_forward:
            ex.publication.release_all()
        ex.reduction.end_step()

    def discard_grads(self) -> None:
        """Finish and forget the reductions of a backward whose step will not be taken
        (``DMuon.zero_grad``).

        Whether to join is read off this rank alone (:meth:`Reduction.started`), so that a
        ``zero_grad()`` after each step costs no collective: a backward that completed on
        every rank started the reductions on every rank, and every rank joins. A backward
        an exception interrupted on some ranks only is not a dropped batch: a rank it
        stopped before any dedicated gradient does not join, and under FSDP2 or DDP the
        others wait in the framework's own collectives of that backward first, under the
        process group's timeout, not DMuon's (docs/reliability.md, Limits): the remedy
        there is to end the process and resume from a checkpoint.
        """
        ex = self.exchange
        red = ex.reduction
        experts = bool(self._replicas.sets) and self._replicas.started()
        if red.started() or experts:  # reductions launched, or left to the flush
            red.flush()  # every rank's, so the collectives pair up as in a step
            self.skip_step()
        elif red.accumulated or red.held_back:  # only no_sync micro-batches: nothing sent
            if ex.reshard_after_forward:
                ex.publication.release_all()
            red.end_step()
            self._end_replicas()

    def settle(self) -> None:
        # the dense weights compared (the expert stacks, DTensors, are not: their
        # broadcasts travel on); ZeRO-3-like: nothing compared to wait for
        if not self.exchange.reshard_after_forward:
            self.exchange.publication.wait_all_layers()

    def agreement_groups(self) -> list[dist.ProcessGroup | None]:
        ex = self.exchange
        # the owner's tp row steps a split matrix together: tp agrees on a skip too
        tp: list[dist.ProcessGroup | None] = list(ex.tensor_groups)
        if self.world_size == 1:
            return tp
        dp = [ex.group] if ex.replicate_group is None else [ex.group, ex.replicate_group]
        return dp + tp

    def replicated_params(self) -> list[EngineParam]:
        # Under ZeRO-3-like resharding a dedicated matrix lives on its owner only.
        skip = self.exchange.reshard_after_forward
        return [
            e
            for e in self.params
            if not is_dtensor(e.param) and not (skip and self._dedicated(e.param))
        ]

    def prepare_grads(self) -> None:
        self.exchange.reduction.wait_all_reduced()
        self._reduce_replicas()

    def changed_gradients(self) -> list[str]:
        changed = self.exchange.reduction.changed_gradients()
        if self._replicas.sets:
            changed += self._replicas.changed_gradients()
        return changed

    def stale_gradients(self) -> list[str]:
        return self.exchange.reduction.stale_gradients()

    def written_weights(self) -> list[str]:
        """The dedicated weights this rank wrote while their publication was in flight
        (:meth:`~dmuon.optim.engine.Publication.written_weights`): the step's agreement
        refuses the step on every rank (such a write is lost on some ranks, which would
        then train different models)."""
        return self.exchange.publication.written_weights()

    def repeats_orthogonalization(self) -> bool:
        """A matrix replicated whole over ``tp`` is stepped by every rank of its owner's
        ``tp`` row, each copy then broadcast over ``dp`` in its own ``tp`` column: the
        copies must be equal, so ``backend="auto"`` takes the torch products
        (:meth:`Engine.products <dmuon.optim.engine.base.Engine.products>`). Any other
        matrix is orthogonalised once, by its owner."""
        return bool(self._whole_by_layer)

    def step(self, stepper: Stepper, report: StepReport) -> None:
        ex = self.exchange
        with report.phase("comm_wait"):
            ex.reduction.flush()
        groups = stepper.param_groups
        if self._in_place_ids:  # the experts, complete here, while reductions travel
            with report.phase("comm_wait"):
                # the last step's broadcasts back, should no forward have waited for them
                # (an owner steps its stacks in place, which they may still be sending)
                self._replicas.wait_broadcast()
                self._reduce_replicas()
            for index in self._matrix_groups:
                stepper.step_matrices(index, None, report)
            self._replicas.start_broadcast()
        for key in self._keys:
            with report.phase("comm_wait"):
                ex.reduction.wait_reduced(key)
                self._settle_owned(key)
            for index in self._matrix_groups:
                stepper.step_matrices(index, key, report)
            with report.phase("scalar"):
                for index, params in self._scalars_by_layer.get(key, ()):
                    stepper.step_scalars(groups[index], params)
            with report.phase("publish"):
                ex.publication.publish(key)
            report.groups += 1
        with report.phase("scalar"):
            for index, params in self._scalars_by_layer.get(None, ()):
                stepper.step_scalars(groups[index], params)
        if self._in_place_ids:
            if ex.publication.experts is not self._replicas:
                # not the stacks the hooks wait for (another optimizer's over this
                # dedication took them): nothing waits in the next forward
                with report.phase("publish"):
                    self._replicas.wait_broadcast()
            self._replicas.end_step()
        ex.reduction.end_step()
        self._replicas_reduced = False

    def _settle_owned(self, key: str) -> None:
        """Carry out the pending sums (``Partial``) of the reduced gradients of layer
        ``key``'s replicated-whole DTensor matrices this rank owns, before the rule reads
        their local tensors as the whole gradient.

        Such a gradient travels over ``dp`` as it arrived (its local part has the
        parameter's shape, and summing over ``tp`` commutes with the reduction over ``dp``),
        so only the owner's ``tp`` row pays the all-reduce over ``tp``. Every rank of that
        row owns the same matrices (one plan) and settles them in one order, after the
        step's agreement (which spans ``tp``: ``OwnerExchange.tensor_groups``). A split
        matrix's pending sum was laid out before its reduction
        (:func:`~dmuon.optim.engine.tensor_split.laid_out_as`), since its local part is not
        the shard's shape. These are matrices, so their pending sums are carried out
        (:func:`~dmuon.optim.engine.tensor_split.settle_split_grads`, which also marks them
        for ``DMuon.zero_grad`` to drop).
        """
        whole = self._whole_by_layer.get(key)
        if whole:  # most layers hold none: no call for them
            settle_split_grads(whole, self.stats)

    def norm_tensors(self) -> tuple[list[torch.Tensor], list[dist.ProcessGroup | None]]:
        ex = self.exchange
        out: list[torch.Tensor] = []
        # Over dp × tp the partial norms are summed over tp too: a shard counts on each rank
        # of its row, a plain tensor (the same on every tp rank) on tp rank 0 only.
        tp = ex.tensor_groups[0] if len(ex.tensor_groups) == 1 else None
        if len(ex.tensor_groups) > 1:
            raise NotImplementedError(
                "clip_grad_norm_ in owner mode with matrices split over different "
                "tensor-parallel groups; clip the gradients before opt.step() yourself"
            )
        tp_first = tp is None or dist.get_rank(tp) == 0
        for e in self.params:
            g = e.param.grad
            if g is None:
                continue
            if not self._dedicated(e.param) and ex.name_of(e.param) is not None and self.rank:
                continue  # all-reduced: the same on every dp rank, counted on dp rank 0
            if e.param in self._replicas:  # summed into its owner among the replicas
                if self._replicas.owns(e.param):
                    out.append(local_tensor(g))
                continue
            if is_dtensor(g):
                if tp is not None and not tp_first and not _spans(g, tp):
                    continue  # FSDP2's rows over dp alone: the same on every tp rank
                out.extend(local_norm_tensors([e], self.stats))  # its shard, once per Replicate
            elif tp_first:
                out.append(g)  # dedicated: only the owner still holds it
        groups = [ex.group] if ex.replicate_group is None else [ex.group, ex.replicate_group]
        return out, groups + ([tp] if tp is not None else [])

    def describe(self) -> dict[str, Any]:
        ex = self.exchange
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "replicate_size": ex.plan.replicate_size,
            "rank": self.rank,
            "plan_digest": ex.plan.digest(),
            "owners": dict(zip(ex.plan.names, ex.plan.owners, strict=True)),
        }


def _spans(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether one of the DTensor ``t``'s mesh dimensions is ``group`` (by its ranks): its
    local parts then differ over ``group``; otherwise every rank of ``group`` holds the same."""
    ranks = dist.get_process_group_ranks(group)
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return any(dist.get_process_group_ranks(mesh.get_group(d)) == ranks for d in range(mesh.ndim))
