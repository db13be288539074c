"""``sign`` mode (Sign-Muon): no gradient reduction for matrices; ranks vote on signs.

Every rank runs ``rule="sign_muon"`` on every matrix with its *own* gradient and
momentum; in the middle of the chain the ranks agree on the elementwise majority
of their signs through :func:`dmuon.comm.majority_vote` with ``method="packed"``
(votes in ``{−1, 0, +1}`` packed 5 per byte: 1/20 of an fp32 all-reduce), and every
rank applies the same voted step (Mishra, Trivedi & Kumar, arXiv 2605.16311). The
scalar parameters' gradients are averaged here (one all-reduce per dtype), since
nothing else synchronises them: train the model without DDP or FSDP2 (a scalar parameter
that is a DTensor is refused before the first step:
:func:`~dmuon.optim.engine.placements.check_placements`).

A matrix whose gradient is missing on this rank but present on another is stepped
with a zero gradient: its momentum decays, and this rank votes with the signs of the
decayed momentum (it abstains, a zero sign, only while its momentum is zero); one
that no rank has a gradient for is skipped everywhere. Every rank holds the momentum
of every matrix (it is rank-specific by design), so a state dict loads back exactly
only on the rank that saved it (another rank's is loaded with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import FlatBucket, OwnerPlan, majority_vote, wait_work
from dmuon.comm.averaging import DIVIDED_BEFORE_THE_SUM
from dmuon.comm.process_groups import group_size
from dmuon.optim.engine.base import Stepper
from dmuon.optim.engine.model_agreement import plan_with_replicated
from dmuon.optim.engine.params import EngineParam
from dmuon.optim.engine.planned import PlannedEngine
from dmuon.optim.engine.report import StepReport
from dmuon.optim.rules import get_rule

__all__ = ["SignEngine"]


class SignEngine(PlannedEngine):
    """Local momentum and Newton–Schulz on every rank; one packed majority vote per batch."""

    mode = "sign"
    carries_presence = True

    def bind(self, stepper: Stepper) -> None:
        super().bind(stepper)
        for g in stepper.param_groups:
            if not stepper.is_scalar(g) and not get_rule(g["rule"]).needs_collective:
                raise ValueError(
                    f"mode='sign' needs a rule that votes across ranks (such as 'sign_muon') for "
                    f"every matrix group; param group {stepper.param_groups.index(g)} has "
                    f"{g['rule']!r}. Use mode='owner' or 'replicated' for the other rules"
                )

        def vote(signs: torch.Tensor) -> torch.Tensor:
            return majority_vote(signs, self.group, method="packed", stats=self.stats)

        stepper.sign_vote = vote

    def steps(self, p: torch.Tensor) -> bool:
        return True

    def check_loaded_description(self, saved: Mapping[str, Any]) -> None:
        """Warn when the dict was saved by another rank or world size: Sign-Muon's momentum
        is this rank's own, so another rank's resumes training, not this rank's run
        (Lightning, for one, loads rank 0's dict on every rank)."""
        if saved.get("mode") != "sign":
            return
        if (saved.get("rank"), saved.get("world_size")) != (self.rank, self.world_size):
            warnings.warn(
                f"loading the sign-mode state dict of rank {saved.get('rank')} of "
                f"{saved.get('world_size')} on rank {self.rank} of {self.world_size}: "
                "Sign-Muon keeps a different momentum on every rank, so this rank resumes "
                "with that rank's momentum, not its own. Save and load one state dict per "
                "rank (opt.state_dict() on each) to resume exactly",
                stacklevel=5,  # the caller of DMuon.load_state_dict
            )

    def checked_plan(self) -> OwnerPlan:
        """The matrices, and the scalar parameters whose gradients this engine all-reduces
        itself (:meth:`_average_scalars`): a rank with another scalar shape, an extra or a
        missing one is named on every rank before the first collective (it aborted a rank
        in gloo's size check, or hung in two different collectives)."""
        scalars = sorted((e.name, e.layer, e.param) for e in self.params if not e.matrix)
        return plan_with_replicated(super().checked_plan(), scalars)

    def repeats_orthogonalization(self) -> bool:
        """Every rank steps every matrix, and with ``local_polar=True`` orthogonalises
        the same voted signs: ``backend="auto"`` takes the torch products on every rank
        (:meth:`Engine.products <dmuon.optim.engine.base.Engine.products>`)."""
        return self.world_size > 1

    def step(self, stepper: Stepper, report: StepReport) -> None:
        with report.phase("comm_wait"):
            present = self.presence()
            self._average_scalars(present)
        matrix_groups = [i for i, g in enumerate(stepper.param_groups) if not stepper.is_scalar(g)]
        for key in self.layers:
            grads = {}
            for e in self.matrices(key):
                if present[e.name]:
                    g = e.param.grad
                    grads[e.param] = torch.zeros_like(e.param) if g is None else g
            for index in matrix_groups:
                stepper.step_matrices(index, key, report, grads=grads)
            report.groups += 1
        with report.phase("scalar"):
            for group in stepper.param_groups:
                if stepper.is_scalar(group):
                    stepper.step_scalars(group)

    def _average_scalars(self, present: dict[str, bool]) -> None:
        n = group_size(self.group)
        # by name: the ranks may list the same parameters in different orders (their
        # entries of one flat buffer would be summed with another parameter's)
        scalars = sorted((e for e in self.params if not e.matrix), key=lambda e: e.name)
        by_dtype: dict[tuple[torch.dtype, torch.device], list[EngineParam]] = {}
        for e in scalars:
            if present[e.name]:
                by_dtype.setdefault((e.param.dtype, e.param.device), []).append(e)
        for es in by_dtype.values():
            tensors = {
                e.name: e.param.grad if e.param.grad is not None else torch.zeros_like(e.param)
                for e in es
            }
            bucket = FlatBucket.from_tensors({k: v.detach() for k, v in tensors.items()})
            if n > 1:
                first = bucket.dtype in DIVIDED_BEFORE_THE_SUM  # fp16: the sum would overflow
                if first:
                    bucket.buffer.div_(n)
                wait_work(
                    dist.all_reduce(bucket.buffer, group=self.group, async_op=True),
                    "all-reduce of scalar gradients",
                    self.group,
                )
                self.stats.record_collective(
                    "all_reduce_scalars", "all_reduce", nbytes=bucket.nbytes, world_size=n
                )
                if not first:
                    bucket.buffer.div_(n)
            for e in es:
                e.param.grad = bucket.view(e.name).view(e.param.shape)

    def norm_tensors(self) -> tuple[list[torch.Tensor], list[dist.ProcessGroup | None]]:
        raise NotImplementedError(
            "gradient clipping in sign mode is not supported: the matrix step is a voted "
            "sign and does not depend on the gradient's scale, and the matrix gradients "
            "are never averaged"
        )
