"""``sharded`` mode, for stock FSDP2: matrices stay sharded; owners get them by all-to-all.

FSDP2 holds every matrix as a ``Shard(0)`` DTensor and has already reduce-scattered
its gradient. Per layer, one all-to-all (:func:`dmuon.comm.shard_all_to_all`) sends
every rank's gradient shard of each matrix to its owner, which runs the rule on the
whole matrices (batched by shape) and sends each rank its rows of the scaled update
back (:func:`dmuon.comm.shard_all_to_all_reverse`); every rank then applies weight
decay and the update to its own shard. Uneven and empty shards (``torch.chunk``
rows) are padded from the global shapes, so all ranks agree on every split size.

Pipelining: layer *i + 1*'s all-to-all is started before layer *i*'s rule runs,
and layer *i*'s results travel back while layer *i + 1* is computed; at most
``pipeline_depth`` layers are in flight. Traffic: twice the shard volume, with each
matrix orthogonalised once. Under HSDP (``Replicate``, ``Shard(0)``) each replica
does this within its shard group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import shard_all_to_all, shard_all_to_all_reverse, shard_range
from dmuon.optim.batches import Entry
from dmuon.optim.engine.base import Stepper, local_norm_tensors
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.placements import placement_of
from dmuon.optim.engine.planned import Pipeline, PlannedEngine
from dmuon.optim.engine.report import StepReport

__all__ = ["ShardedEngine", "shard_group_of"]


def shard_group_of(p: torch.Tensor, name: str) -> tuple[Any, Any]:
    """``(mesh, mesh_dim)`` a ``Shard(0)`` DTensor parameter is sharded over.

    Raises:
        ValueError: not a DTensor, not sharded on dim 0, or sharded over several mesh
            dimensions (the other dimensions must be ``Replicate``, as in HSDP).
    """
    if not is_dtensor(p):
        raise ValueError(
            f"parameter {name!r} is not a DTensor; sharded mode steps FSDP2's sharded "
            "matrices (call fully_shard on the model first, or pick another mode)"
        )
    pl = placement_of(p, name)
    if not pl.row_sharded:
        raise ValueError(
            f"parameter {name!r} has placements {pl.describe()} ({pl.what()}); sharded mode "
            "needs Shard(0) over exactly one mesh dimension and Replicate() over the others "
            "(FSDP2's row sharding, HSDP)"
        )
    return p.device_mesh, pl.shards[0][0]  # type: ignore[attr-defined]


def _collector(
    by_param: dict[int, EngineParam], results: dict[str, torch.Tensor]
) -> Callable[[Entry, torch.Tensor, float], None]:
    """A sink that writes ``scale · update`` into each owned matrix's full result."""

    def sink(entry: Entry, update: torch.Tensor, scale: float) -> None:
        e = by_param[id(entry.param)]
        target = entry.tensor_block(results[e.name].view(e.param.shape))
        target.copy_(update.reshape(target.shape)).mul_(scale)

    return sink


class ShardedEngine(PlannedEngine):
    """All-to-all to owners, batched rule there, all-to-all back, apply on shards."""

    mode = "sharded"

    def bind(self, stepper: Stepper) -> None:
        from dmuon.optim.engine.params import collect_params

        matrices = [e for e in collect_params(stepper.param_groups) if e.matrix]
        # Meshes are compared by their ranks, not by identity: FSDP2 may hand equal
        # DeviceMesh objects to different modules (seen with several models per process).
        meshes: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        where: dict[tuple[Any, ...], str] = {}
        for e in matrices:
            m, d = shard_group_of(e.param, e.name)
            key = (tuple(m.mesh.flatten().tolist()), tuple(m.mesh.shape), d)
            meshes.setdefault(key, (m, d))
            where.setdefault(key, e.name)
        if len(meshes) > 1:
            found = "; ".join(
                f"{where[k]!r} over ranks {list(k[0])} (dim {k[2]})" for k in list(meshes)[:3]
            )
            raise ValueError(
                "sharded mode needs every matrix sharded over the same mesh dimension; "
                f"found {len(meshes)} different ones: {found}"
            )
        if meshes and self.group is None:
            mesh, dim = next(iter(meshes.values()))
            self.group = mesh.get_group(dim)
        super().bind(stepper)

    def _shard(self, e: EngineParam, t: torch.Tensor) -> torch.Tensor:
        """A DTensor's local rows, viewed with the item's trailing shape."""
        local = t.to_local()  # type: ignore[attr-defined]
        return local.view(local.shape[0], *e.item.shape[1:])

    def step(self, stepper: Stepper, report: StepReport) -> None:
        with report.phase("comm_wait"):
            present = self.agree_presence()
        matrix_groups = [i for i, g in enumerate(stepper.param_groups) if not stepper.is_scalar(g)]
        n = self.world_size

        def start(key: str) -> Any:
            shards = {}
            for e in self.matrices(key):
                g = e.param.grad
                if g is None:
                    rows = shard_range(e.item.shape[0], n, self.rank)[1]
                    shards[e.name] = torch.zeros(
                        (rows, *e.item.shape[1:]), dtype=e.item.dtype, device=e.param.device
                    )
                else:
                    shards[e.name] = self._shard(e, g)
            return shard_all_to_all(shards, self.subplan(key), group=self.group, stats=self.stats)

        def apply(key: str, updates: dict[str, torch.Tensor]) -> None:  # on the local shards
            with report.phase("apply"):
                for e in self.matrices(key):
                    if not present[e.name]:
                        continue
                    group = stepper.param_groups[e.group_index]
                    lr, wd = float(group["lr"]), float(group["weight_decay"])
                    w = self._shard(e, e.param.detach())
                    if wd != 0.0 and lr != 0.0:
                        w.mul_(1.0 - lr * wd)
                    w.add_(updates[e.name], alpha=-lr)

        pipe = Pipeline(self.pipeline_depth, report)
        incoming = {}
        for key in self.layers[:1]:
            incoming[key] = start(key)
        for i, key in enumerate(self.layers):
            with report.phase("comm_wait"):
                full = incoming.pop(key).wait()
            if i + 1 < len(self.layers):
                incoming[self.layers[i + 1]] = start(self.layers[i + 1])
            mine = [e for e in self.matrices(key) if self.owner_of(e.param) == self.rank]
            grads = {e.param: full[e.name].view(e.param.shape) for e in mine if present[e.name]}
            results = {
                e.name: torch.zeros(e.item.shape, dtype=e.item.dtype, device=e.param.device)
                for e in mine
            }
            sink = _collector({id(e.param): e for e in mine}, results)
            for index in matrix_groups:
                stepper.step_matrices(index, key, report, grads=grads, sink=sink)
            with report.phase("publish"):
                back = shard_all_to_all_reverse(
                    results, self.subplan(key), group=self.group, stats=self.stats
                )
            pipe.push(back, functools.partial(apply, key))
            report.groups += 1
        with report.phase("scalar"):
            for g in stepper.param_groups:
                if stepper.is_scalar(g):
                    stepper.step_scalars(g)
        pipe.drain()

    def agreement_groups(self) -> list[dist.ProcessGroup | None]:
        return self.norm_tensors_groups() if self.world_size > 1 else []

    def norm_tensors_groups(self) -> list[dist.ProcessGroup | None]:
        """Every mesh dimension of the sharded parameters (HSDP: shard and replicate)."""
        for e in self.params:
            if is_dtensor(e.param):
                mesh = e.param.device_mesh  # type: ignore[attr-defined]
                return [mesh.get_group(d) for d in range(mesh.ndim)]
        return [self.group]

    def norm_tensors(self) -> tuple[list[torch.Tensor], list[dist.ProcessGroup | None]]:
        out = local_norm_tensors(self.params)
        groups: list[dist.ProcessGroup | None] = []
        for e in self.params:
            if is_dtensor(e.param):
                mesh = e.param.device_mesh  # type: ignore[attr-defined]
                groups = [mesh.get_group(d) for d in range(mesh.ndim)]
                break
        return out, groups or [self.group]
