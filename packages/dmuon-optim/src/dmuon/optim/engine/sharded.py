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

FSDP2 over tensor parallelism (a ``dp × tp`` mesh: ``_StridedShard(0)``/``Shard(0)``
on ``dp``, ``Shard(0)``/``Shard(1)`` on ``tp``;
:attr:`~dmuon.optim.engine.placements.MatrixPlacement.sharded_split`): the rows of a
matrix gathered over ``dp`` are this rank's ``tp`` shard, so the all-to-all runs over
``dp`` and carries ``tp`` shards. Owners are planned by whole shapes, so every ``tp``
column plans the same ones; the owner's ``tp`` row steps each matrix together, each
rank its shard, with the tensor-parallel Gram Newton–Schulz
(:mod:`~dmuon.optim.engine.tensor_split`: all-reduces of the small Gram matrix over
``tp``). No matrix is gathered over ``tp``; the work of each is divided by ``tp`` and
spread over ``dp``. A matrix FSDP2 shards over ``dp`` alone (``Replicate`` or no
``tp`` dimension) is stepped whole by its owner on every ``tp`` rank alike.

Expert stacks sharded along their expert dimension
(:attr:`~dmuon.optim.engine.placements.MatrixPlacement.whole_experts`: FSDP2's
``Shard(0)`` rows of a stack, an ``ep`` split, or both, as Hugging Face's expert
parallelism lays them out) are whole matrices on every rank, with whole gradients:
each rank steps its own as one batch where they are, after the layers, with no
collective and no owner (they are left out of the plan, which balances the other
matrices around each rank's experts: ``plan_owners(held=...)``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import (
    MatrixItem,
    shard_all_to_all,
    shard_all_to_all_reverse,
    shard_range,
    wait_work,
)
from dmuon.comm.flags import flag_device
from dmuon.comm.process_groups import group_size
from dmuon.comm.torch_compat import all_gather_single
from dmuon.optim.apply import apply_update
from dmuon.optim.batch_layout import Entry
from dmuon.optim.engine.base import Stepper, local_norm_tensors, world_of
from dmuon.optim.engine.params import EngineParam, is_dtensor, subplan
from dmuon.optim.engine.placements import placement_of, placement_of_param
from dmuon.optim.engine.planned import Pipeline, PlannedEngine
from dmuon.optim.engine.report import StepReport
from dmuon.optim.engine.split_presence import PresenceGroups
from dmuon.optim.engine.tensor_split import sharded_split_of, tensor_parallel_shape
from dmuon.optim.matrix_split import MatrixSplit, local_tensor

__all__ = ["LOCAL_EXPERTS", "ShardedEngine", "shard_group_of"]

LOCAL_EXPERTS = "<local experts>"
"""The pipeline group of the expert stacks each rank steps where they are."""


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
    if pl.sharded_split:  # FSDP2 over tensor parallelism: the rows over dp
        return p.device_mesh, pl.sharded_split_dims[0]  # type: ignore[attr-defined]
    if not pl.row_sharded:
        raise ValueError(
            f"parameter {name!r} has placements {pl.summary()} ({pl.what()}); sharded mode "
            "needs Shard(0) over exactly one mesh dimension and Replicate() over the others "
            "(FSDP2's row sharding, HSDP), or FSDP2 over tensor parallelism"
        )
    return p.device_mesh, pl.shards[0][0]  # type: ignore[attr-defined]


def _collector(
    by_param: dict[int, EngineParam],
    results: dict[str, torch.Tensor],
    shape_of: Callable[[EngineParam], tuple[int, ...]],
) -> Callable[[Entry, torch.Tensor, float], None]:
    """A sink that writes ``scale · update`` into each owned matrix's full result."""

    def sink(entry: Entry, update: torch.Tensor, scale: float) -> None:
        e = by_param[id(entry.param)]
        target = entry.tensor_block(results[e.name].view(shape_of(e)))
        target.copy_(update.reshape(target.shape)).mul_(scale)

    return sink


class ShardedEngine(PlannedEngine):
    """All-to-all to owners, batched rule there, all-to-all back, apply on shards."""

    mode = "sharded"
    carries_presence = True
    _local_experts: frozenset[str] | set[str] = frozenset()

    def bind(self, stepper: Stepper) -> None:
        from dmuon.optim.engine.params import collect_params

        params = collect_params(stepper.param_groups)
        matrices = [e for e in params if e.matrix]
        self._local_experts = {e.name for e in matrices if placement_of_param(e).whole_experts}
        matrices = [e for e in matrices if e.name not in self._local_experts]
        # Meshes are compared by the ranks of the group the rows are sharded over, not by
        # identity: FSDP2 may hand equal DeviceMesh objects to different modules (seen
        # with several models per process), and under tensor parallelism the matrices it
        # shards over dp alone sit on the 1-D dp mesh, the split ones on the dp × tp mesh.
        meshes: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        where: dict[tuple[Any, ...], str] = {}
        for e in matrices:
            m, d = shard_group_of(e.param, e.name)
            key = (tuple(dist.get_process_group_ranks(m.get_group(d))), m.size(d))
            meshes.setdefault(key, (m, d))
            where.setdefault(key, e.name)
        if len(meshes) > 1:
            found = "; ".join(f"{where[k]!r} over ranks {list(k[0])}" for k in list(meshes)[:3])
            raise ValueError(
                "sharded mode needs every matrix's rows sharded over the same group of ranks; "
                f"found {len(meshes)} different ones: {found}"
            )
        if meshes and self.group is None:
            mesh, dim = next(iter(meshes.values()))
            self.group = mesh.get_group(dim)
        # what travels over dp for a matrix split over tp is this rank's tp shard
        self._shapes = {
            e.name: tensor_parallel_shape(e.param, e.name)
            for e in matrices
            if placement_of(e.param, e.name).sharded_split
        }
        self._mesh_groups, self._counted = _norm_layout(params)
        experts = [e for e in params if e.name in self._local_experts]
        if experts and "held" not in self.plan_options:
            self.plan_options = {**self.plan_options, "held": _held_experts(experts, self.group)}
        super().bind(stepper)  # plans, and asks agreement_groups()
        if self._shapes:
            assert self.plan is not None
            for layer in self.layers:
                names = [e.name for e in self.matrices(layer)]
                self._subplans[layer] = subplan(self.plan, names, self._shapes)

    def planned(self, e: EngineParam) -> bool:
        return e.matrix and e.name not in self._local_experts

    def step_groups(self) -> list[str | None]:
        return [*self.layers, LOCAL_EXPERTS, None]

    def group_of(self, p: torch.Tensor) -> str | None:
        e = self.info(p)
        if e is not None and e.name in self._local_experts:
            return LOCAL_EXPERTS
        return super().group_of(p)

    def on_shard(self, p: torch.Tensor) -> bool:
        """A stack of whole experts is stepped on this rank's local experts."""
        e = self.info(p)
        return (e is not None and e.name in self._local_experts) or super().on_shard(p)

    def shape_of(self, e: EngineParam) -> tuple[int, ...]:
        """The shape of what travels and is stepped for ``e``: its ``tp`` shard under FSDP2
        over tensor parallelism, else the whole matrix."""
        return self._shapes.get(e.name, tuple(e.item.shape))

    def split_of(self, p: torch.Tensor) -> MatrixSplit | None:
        """A matrix under FSDP2 over tensor parallelism is stepped on its ``tp`` shards by its
        owner's ``tp`` row."""
        info = self.info(p)
        return sharded_split_of(p, info.name if info is not None else "", self.stats)

    def _shard(self, e: EngineParam, t: torch.Tensor) -> torch.Tensor:
        """A DTensor's local rows, viewed with the item's trailing shape."""
        local = t.to_local()  # type: ignore[attr-defined]
        return local.view(local.shape[0], *self.shape_of(e)[1:])

    def repeats_orthogonalization(self) -> bool:
        """Whether ranks outside the planning group step the same matrices: HSDP's
        replicas (each replica plans and steps within its shard group) and, on FSDP2 over
        tensor parallelism, every ``tp`` rank of a matrix FSDP2 shards over ``dp`` alone.
        Their copies must be equal, so ``backend="auto"`` takes the torch products
        (:meth:`Engine.products <dmuon.optim.engine.base.Engine.products>`)."""
        return group_size(None) > group_size(self.group)

    def step(self, stepper: Stepper, report: StepReport) -> None:
        with report.phase("comm_wait"):
            present = self.presence()
        matrix_groups = [i for i, g in enumerate(stepper.param_groups) if not stepper.is_scalar(g)]
        n = self.world_size

        def start(key: str) -> Any:
            shards = {}
            for e in self.matrices(key):
                g = e.param.grad
                if g is None:
                    shape = self.shape_of(e)
                    rows = shard_range(shape[0], n, self.rank)[1]
                    shards[e.name] = torch.zeros(
                        (rows, *shape[1:]), dtype=e.item.dtype, device=e.param.device
                    )
                else:
                    shards[e.name] = self._shard(e, g)
            return shard_all_to_all(shards, self.subplan(key), group=self.group, stats=self.stats)

        def apply(key: str, updates: dict[str, torch.Tensor]) -> None:  # on the local shards
            with report.phase("apply"):
                by_group: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
                for e in self.matrices(key):
                    if present[e.name]:
                        weights, scaled = by_group.setdefault(e.group_index, ([], []))
                        weights.append(self._shard(e, e.param.detach()))
                        scaled.append(updates[e.name])
                for index, (weights, scaled) in by_group.items():
                    group = stepper.param_groups[index]
                    # the updates arrive scaled (scale · U): apply_update with scale 1, on
                    # this rank's rows (cautious decay is elementwise)
                    apply_update(
                        weights,
                        scaled,
                        lr=float(group["lr"]),
                        weight_decay=float(group["weight_decay"]),
                        scale=1.0,
                        cautious=bool(group.get("cautious_weight_decay", False)),
                    )

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
            grads = {e.param: full[e.name].view(self.shape_of(e)) for e in mine if present[e.name]}
            results = {
                e.name: torch.zeros(self.shape_of(e), dtype=e.item.dtype, device=e.param.device)
                for e in mine
            }
            sink = _collector({id(e.param): e for e in mine}, results, self.shape_of)
            for index in matrix_groups:
                stepper.step_matrices(index, key, report, grads=grads, sink=sink)
            with report.phase("publish"):
                back = shard_all_to_all_reverse(
                    results,
                    self.subplan(key),
                    group=self.group,
                    stats=self.stats,
                    # a rank owning none of the layer's matrices: its buffers still there
                    device=self.matrices(key)[0].param.device,
                )
            pipe.push(back, functools.partial(apply, key))
            report.groups += 1
        if self._local_experts:  # each rank its own whole experts, where they are
            for index in matrix_groups:
                stepper.step_matrices(index, LOCAL_EXPERTS, report)
        with report.phase("scalar"):
            for g in stepper.param_groups:
                if stepper.is_scalar(g):
                    stepper.step_scalars(g)
        pipe.drain()

    def split_presence(self) -> PresenceGroups:
        """None: this mode does not agree on it. FSDP2's reduce-scatter in the backward
        gives every rank of its mesh a gradient or none, and the step's presence flags
        agree over ``dp``; a gradient dropped afterwards on some ``tp`` ranks only ends in
        the deadline's error naming the collectives, not the parameter."""
        return []

    def agreement_groups(self) -> list[dist.ProcessGroup | None]:
        # the owner's tp row steps a split matrix together: tp agrees on a skip too
        return self.norm_tensors_groups() if self.world_size > 1 or self._shapes else []

    def norm_tensors_groups(self) -> list[dist.ProcessGroup | None]:
        """Every mesh dimension of the widest mesh of the sharded parameters (HSDP: shard
        and replicate; FSDP2 over tensor parallelism: dp and tp)."""
        return list(self._mesh_groups) or [self.group]

    def norm_tensors(self) -> tuple[list[torch.Tensor], list[dist.ProcessGroup | None]]:
        # each gradient element counted once over the widest mesh: a DTensor's shard on
        # the first rank of its own Replicate dims, and on the first rank of the widest
        # mesh's dims its own mesh does not span (FSDP2's dp-only parameters beside tp)
        out = local_norm_tensors([e for e in self.params if self._counted.get(e.name, True)])
        return out, self.norm_tensors_groups()


def _held_experts(
    experts: list[EngineParam], group: dist.ProcessGroup | None
) -> list[list[MatrixItem]]:
    """Per rank of ``group``, the experts it steps where they are, as the planner's
    ``held`` load (:func:`dmuon.comm.plan_owners`): the dense matrices' owners are then
    balanced around each rank's experts (uneven splits, e.g. 3 experts on 2 ranks, give
    ranks different loads). The counts are all-gathered once, at bind: every rank then
    plans with the same numbers.

    Examples:
        >>> import torch
        >>> from dmuon.comm import MatrixItem
        >>> from dmuon.optim.engine.params import EngineParam
        >>> w = torch.zeros(3, 4, 5)  # one process: it holds all three experts
        >>> e = EngineParam("w", w, 0, 0, True, "l0", MatrixItem("w", (3, 4, 5), layer="l0"))
        >>> _held_experts([e], None)
        [[MatrixItem(name='w[rank 0]', shape=(3, 4, 5), dtype=torch.float32, layer='l0')]]
    """
    experts = sorted(experts, key=lambda e: e.name)
    mine = torch.tensor(
        [math.prod(local_tensor(e.param).shape[:-2]) for e in experts],
        dtype=torch.int64,
        device=flag_device(group),
    )
    _, n = world_of(group)
    counts = mine.unsqueeze(0)
    if n > 1:
        counts = torch.empty(n * len(experts), dtype=torch.int64, device=mine.device)  # flat
        wait_work(
            all_gather_single(counts, mine, group=group, async_op=True),
            "all-gather of each rank's expert counts (sharded mode's plan)",
            group,
        )
        counts = counts.view(n, len(experts))
    return [
        [
            MatrixItem(f"{e.name}[rank {r}]", (int(c), *e.item.shape[-2:]), e.item.dtype, e.layer)
            for e, c in zip(experts, counts[r].tolist(), strict=True)
            if c > 0
        ]
        for r in range(n)
    ]


def _norm_layout(
    params: list[EngineParam],
) -> tuple[list[dist.ProcessGroup], dict[str, bool]]:
    """The groups of the widest mesh among ``params``' DTensors, and for each parameter
    whether this rank counts it in a norm summed over them: not when the parameter is
    the same on this rank as on a rank before it along a dimension its mesh does not
    span (a plain tensor, or a matrix on the 1-D ``dp`` mesh beside a ``dp × tp`` one)."""
    meshes = [e.param.device_mesh for e in params if is_dtensor(e.param)]  # type: ignore[attr-defined]
    if not meshes:
        return [], {}
    widest = max(meshes, key=lambda m: m.ndim)
    me = dist.get_rank()
    dims = [
        (d, set(dist.get_process_group_ranks(widest.get_group(d))))
        for d in range(widest.ndim)
        if widest.size(d) > 1
    ]
    counted: dict[str, bool] = {}
    for e in params:
        spans = (
            set(e.param.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]
            if is_dtensor(e.param)
            else {me}
        )
        counted[e.name] = all(
            widest.get_local_rank(d) == 0 for d, ranks in dims if ranks & spans == {me}
        )
    return [widest.get_group(d) for d in range(widest.ndim)], counted
