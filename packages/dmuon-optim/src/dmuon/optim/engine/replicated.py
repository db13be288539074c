"""``replicated`` mode, for stock DDP: gradients arrive all-reduced; owners orthogonalise.

DDP has already averaged every gradient on every rank. Each rank runs the rule
only on the matrices it owns (batched by shape), updates them in place, and one
all-gather per layer and dtype (:func:`dmuon.comm.all_gather_updates`) gives every
rank every owner's new weights. Gathering the new weights rather than the updates
keeps every rank bit-identical to the owner. Traffic on top of DDP's all-reduce:
one all-gather of the matrices, ``(N−1)/N·P``; Newton–Schulz work divided by ``N``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dmuon.comm import all_gather_updates
from dmuon.optim.engine.base import Stepper
from dmuon.optim.engine.planned import Pipeline, PlannedEngine
from dmuon.optim.engine.report import StepReport

__all__ = ["ReplicatedEngine"]


class ReplicatedEngine(PlannedEngine):
    """Owners step their matrices; the new weights are all-gathered layer by layer."""

    mode = "replicated"

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
                    view = e.param.detach().view(e.item.shape)
                    (mine if self.owner_of(e.param) == self.rank else others)[e.name] = view
                handle = all_gather_updates(
                    mine, self.subplan(key), group=self.group, out=others, stats=self.stats
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
        # every other parameter on rank 0.
        out = []
        for e in self.params:
            g = e.param.grad
            if g is None:
                continue
            owner = self.owner_of(e.param)
            if owner == self.rank or (owner is None and self.rank == 0):
                out.append(g)
        return out, [self.group]
