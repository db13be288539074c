"""``replicated`` mode, for stock DDP: gradients arrive all-reduced; owners orthogonalise.

DDP has already averaged every gradient on every rank. Each rank runs the rule
only on the matrices it owns (batched by shape), updates them in place, and one
all-gather per layer and dtype (:func:`dmuon.comm.all_gather_updates`) gives every
rank every owner's new weights. Gathering the new weights rather than the updates
keeps every rank bit-identical to the owner. Traffic on top of DDP's all-reduce:
one all-gather of the matrices, ``(N−1)/N·P``; Newton–Schulz work divided by ``N``.

Tensor parallelism (a ``dp × tp`` mesh, ``process_group`` the ``dp`` group): a
matrix split over ``tp`` (``ColwiseParallel``, ``RowwiseParallel``) is planned by its
whole shape, so every ``tp`` column plans the same owners; the owner's ``tp`` row
steps it together, each rank its shard, with the tensor-parallel Gram Newton–Schulz
(:mod:`~dmuon.optim.engine.tensor_split`: all-reduces of the small Gram matrix over
``tp``), and the all-gather over ``dp`` carries each rank's shard. No matrix is
gathered over ``tp``; the work of each is divided by ``tp`` and spread over ``dp``.
A matrix replicated whole over ``tp`` (``Replicate()`` on every mesh dimension) is
stepped like a plain one on its local tensor, by its owner's ``tp`` row alike, after its
gradient's pending sum (``Partial``) has been carried out at the start of the step.

Expert parallelism (a ``dp × ep`` mesh, ``process_group`` the ``dp`` group): an expert
stack split over ``ep`` (:mod:`~dmuon.optim.engine.expert_split`) is planned by its
whole shape, owned by one of the replicas that hold the same experts, stepped there as
a batch of whole matrices, and its new experts all-gathered over ``dp`` — instead of
every replica repeating the experts' Newton–Schulz. A skipped step and the gradient
norm agree over ``ep`` too (every ``ep`` rank holds other experts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon.comm import all_gather_updates
from dmuon.optim.engine.base import Stepper, local_norm_tensors
from dmuon.optim.engine.expert_split import expert_group_of, expert_groups
from dmuon.optim.engine.params import is_dtensor, subplan
from dmuon.optim.engine.planned import Pipeline, PlannedEngine
from dmuon.optim.engine.report import StepReport
from dmuon.optim.engine.tensor_split import split_groups, split_of
from dmuon.optim.matrix_split import MatrixSplit, local_tensor

__all__ = ["ReplicatedEngine"]


class ReplicatedEngine(PlannedEngine):
    """Owners step their matrices; the new weights are all-gathered layer by layer."""

    mode = "replicated"

    def bind(self, stepper: Stepper) -> None:
        super().bind(stepper)
        # what travels for a split matrix or an expert stack is this rank's part (the
        # plan weighed the whole)
        local = {
            e.name: tuple(local_tensor(e.param).shape)
            for e in self.matrices()
            if self.split_of(e.param) is not None or expert_group_of(e) is not None
        }
        if local:
            assert self.plan is not None
            for key in self.layers:
                names = [e.name for e in self.matrices(key)]
                self._subplans[key] = subplan(self.plan, names, local)

    def agreement_groups(self) -> list[dist.ProcessGroup | None]:
        # the owner's tp row steps a split matrix together: tp agrees on a skip too; the
        # ep ranks hold other experts beside the same dense matrices: they agree as well
        return (
            super().agreement_groups()
            + list(split_groups(self.params))
            + list(expert_groups(self.params))
        )

    def split_of(self, p: torch.Tensor) -> MatrixSplit | None:
        """A tensor-parallel matrix is stepped on its shards by its owner's ``tp`` row."""
        info = self.info(p)
        return split_of(p, info.name if info is not None else "")

    def on_shard(self, p: torch.Tensor) -> bool:
        """A tensor-parallel matrix, an expert stack split over ``ep`` (its owner steps
        the experts this rank's replicas hold), and a matrix replicated whole (its owner
        steps its local tensor, the whole matrix, and the all-gather carries it)."""
        info = self.info(p)
        return (
            self.split_of(p) is not None
            or self.replicated_whole(p)
            or (info is not None and expert_group_of(info) is not None)
        )

    def repeats_orthogonalization(self) -> bool:
        """A matrix replicated whole over ``tp`` is stepped by every rank of its owner's
        ``tp`` row, each copy then all-gathered over ``dp`` to its own ``tp`` column: the
        copies must be equal, so ``backend="auto"`` takes the torch products
        (:meth:`Engine.products <dmuon.optim.engine.base.Engine.products>`). Every other
        matrix is computed once, by its owner, and its bytes all-gathered."""
        return bool(self._whole)

    def step(self, stepper: Stepper, report: StepReport) -> None:
        matrix_groups = [i for i, g in enumerate(stepper.param_groups) if not stepper.is_scalar(g)]
        pipe = Pipeline(self.pipeline_depth, report)
        for key in self.layers:
            for index in matrix_groups:
                stepper.step_matrices(index, key, report)
            with report.phase("publish"):
                mine: dict[str, torch.Tensor] = {}
                others: dict[str, torch.Tensor] = {}
                for e in self.matrices(key):
                    shape = self.subplan(key).item(e.name).shape
                    view = local_tensor(e.param.detach()).view(shape)
                    (mine if self.owner_of(e.param) == self.rank else others)[e.name] = view
                handle = all_gather_updates(
                    mine,
                    self.subplan(key),
                    group=self.group,
                    out=others,
                    stats=self.stats,
                    device=view.device,  # a rank owning none of the layer's: still there
                )
            pipe.push(handle, lambda _: None)
            report.groups += 1
        with report.phase("scalar"):
            for g in stepper.param_groups:
                if stepper.is_scalar(g):
                    stepper.step_scalars(g)
        pipe.drain()

    def norm_tensors(self) -> tuple[list[torch.Tensor], list[dist.ProcessGroup | None]]:
        # Every rank holds the same averaged gradients: each matrix counts on its owner,
        # every other parameter on rank 0. Under tensor (expert) parallelism the sum runs
        # over the tensor-parallel (expert-parallel) group too: a split matrix (an expert
        # stack) counts its shard (its experts) on each rank of its owner's row, a plain
        # tensor (the same on every tp/ep rank) on tp/ep rank 0 only.
        tp = self._split_group()
        tp_first = tp is None or dist.get_rank(tp) == 0
        out: list[torch.Tensor] = []
        for e in self.params:
            g = e.param.grad
            if g is None:
                continue
            owner = self.owner_of(e.param)
            if not (owner == self.rank or (owner is None and self.rank == 0)):
                continue
            if not is_dtensor(g) or self.replicated_whole(e.param):
                # the same on every rank of its mesh, as a plain gradient on every tp rank
                if tp_first:
                    out.append(local_tensor(g))
            elif owner is not None:
                out.append(local_tensor(g))  # a split matrix: this rank's shard
            else:
                # its shard, once over Replicate dims
                out.extend(local_norm_tensors([e], self.stats))
        return out, [self.group] + ([tp] if tp is not None else [])

    def _split_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group of the split matrices, or the expert-parallel group of
        the expert stacks (``None``: neither)."""
        found: list[dist.ProcessGroup] = []
        seen: set[tuple[int, ...]] = set()
        for g in split_groups(self.matrices()) + expert_groups(self.matrices()):
            ranks = tuple(dist.get_process_group_ranks(g))
            if ranks not in seen:  # one mesh dim can hold both (tp and ep alike)
                seen.add(ranks)
                found.append(g)
        if len(found) > 1:
            raise NotImplementedError(
                f"clip_grad_norm_ in mode='replicated' with matrices split over different "
                f"tensor- or expert-parallel groups ({sorted(seen)}); clip the DTensor gradients "
                "with torch.nn.utils.clip_grad_norm_ before opt.step()"
            )
        return found[0] if found else None
