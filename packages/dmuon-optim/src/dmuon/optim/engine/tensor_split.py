"""Tensor-parallel matrices stepped on their shards: the split read from DTensor placements.

A 2-D parameter sharded along one of its dimensions over exactly one mesh dimension
(``Shard(0)``: ``ColwiseParallel``'s rows, or FSDP2's; ``Shard(1)``:
``RowwiseParallel``'s columns), ``Replicate()`` over any other, is *split*: each
rank of that mesh dimension's process group holds a block of whole rows or whole
columns, and its gradient is the same block of the whole gradient. A rule whose
every link computes on a shard what it computes on the whole
(:attr:`dmuon.optim.Rule.splits`) then steps the shard in place, with the polar
factor from :func:`dmuon.kernels.tp_gram_newton_schulz`: one all-reduce of the small
Gram matrix over the group at the start and at each restart, never a gather.

Per matrix of shape ``m × n`` split ``t`` ways along ``n`` (columns; rows: swap),
with ``r`` Gram restarts, in the compute dtype of ``b`` bytes: ``(r + 1)`` all-reduces
of ``m² · b`` bytes, and the normalisation's two of ``B`` and ``B + 1`` fp32 entries
for a batch of ``B`` matrices, and ``2·m·n·(n/t)``-scale products on each rank
instead of the whole ``m·n·n``.

``single`` mode steps split matrices this way (every data-parallel replica repeats
the work of its tensor-parallel group). ``replicated`` mode plans owners over its
data-parallel group, which must cross the split's group in this rank alone
(:func:`check_split_groups`: a ``dp × tp`` mesh, owners over ``dp``): the owner's
tensor-parallel row steps the matrix together, each rank its shard, and the
all-gather over ``dp`` carries shards; ``sharded`` mode does the same on FSDP2 over
tensor parallelism, owners over ``dp``. A rule that needs the whole matrix gathers the
shards instead (``Bucket.gathered``). The other modes refuse them
(:mod:`~dmuon.optim.engine.placements`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from dmuon.comm import CommStats, default_stats, shard_range, wait_work
from dmuon.comm.chunk_gather import all_gather_chunks
from dmuon.optim.engine.expert_split import expert_group_of, in_place_replicas
from dmuon.optim.engine.params import EngineParam, is_dtensor
from dmuon.optim.engine.placements import placement_of, placement_of_param
from dmuon.optim.engine.relayout import relaid, summed
from dmuon.optim.matrix_split import MatrixSplit

__all__ = [
    "GATHER_STATS_NAME",
    "STATS_NAME",
    "check_split_groups",
    "drop_relaid_grads",
    "laid_out_as",
    "mark_relaid",
    "settle_pending_grad",
    "settle_pending_grads",
    "settle_split_grads",
    "sharded_split_of",
    "split_group_of",
    "split_groups",
    "split_of",
    "tensor_groups",
    "tensor_parallel_shape",
]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


GATHER_STATS_NAME = "tensor_parallel_gather"
"""The name under which :func:`dmuon.comm.default_stats` counts the all-gathers of the
gather path (a split matrix orthogonalised whole; :func:`dmuon.comm.tensor_parallel_path`)."""

STATS_NAME = "tensor_parallel_reduce"
"""The name under which :func:`dmuon.comm.default_stats` counts every reduction a chain
makes over the group of a split matrix: the Gram matrices and the normalisation's
scalars of the polar factor, and the Frobenius norms and row sums of NorMuon's and
AdaMuon's normalisations."""


def split_group_of(p: torch.Tensor, name: str = "") -> tuple[int, dist.ProcessGroup] | None:
    """The mesh dimension and process group a split matrix ``p`` is split over, or
    ``None`` when ``p`` is not a split matrix (a plain tensor, not 2-D, or a layout that
    is not :attr:`~dmuon.optim.engine.placements.MatrixPlacement.tensor_split`)."""
    if not is_dtensor(p) or p.dim() != 2:
        return None
    pl = placement_of(p, name)
    if not pl.tensor_split:
        return None
    mesh_dim = pl.shards[0][0]
    return mesh_dim, p.device_mesh.get_group(mesh_dim)  # type: ignore[attr-defined]


def split_of(p: torch.Tensor, name: str = "", stats: CommStats | None = None) -> MatrixSplit | None:
    """The :class:`~dmuon.optim.matrix_split.MatrixSplit` of ``p``, or ``None`` when it is not a
    split matrix (a plain tensor, a tensor that is not 2-D, or a layout that is not
    :attr:`~dmuon.optim.engine.placements.MatrixPlacement.tensor_split`). Its
    ``reduce`` counts the bytes it moves in ``stats`` (default
    :func:`dmuon.comm.default_stats`) under :data:`STATS_NAME`.

    Examples:
        >>> import torch
        >>> split_of(torch.zeros(4, 4)) is None
        True
    """
    found = split_group_of(p, name)
    if found is None:
        return None
    mesh_dim = found[0]
    tensor_dim = placement_of(p, name).shards[0][1]
    return _matrix_split(p, mesh_dim, tensor_dim, stats)


def tensor_parallel_shape(p: torch.Tensor, name: str = "") -> tuple[int, int]:
    """The shape of this rank's tensor-parallel shard of a
    :attr:`~dmuon.optim.engine.placements.MatrixPlacement.sharded_split` matrix (FSDP2 over
    tensor parallelism): what its rows gathered over ``dp`` make. The ``tp`` split follows
    ``torch.chunk``, as DTensor's ``Shard`` does (uneven and empty shards included).

    Examples:
        >>> from dmuon.comm import shard_range
        >>> [shard_range(15, 2, r)[1] for r in range(2)]  # a 15-row matrix over tp 2
        [8, 7]
    """
    pl = placement_of(p, name)
    _, d_tp, split = pl.sharded_split_dims
    mesh = p.device_mesh  # type: ignore[attr-defined]
    shape = [int(p.shape[0]), int(p.shape[1])]
    shape[split] = shard_range(shape[split], int(mesh.size(d_tp)), int(mesh.get_local_rank(d_tp)))[
        1
    ]
    return shape[0], shape[1]


def sharded_split_of(
    p: torch.Tensor, name: str = "", stats: CommStats | None = None
) -> MatrixSplit | None:
    """The :class:`~dmuon.optim.matrix_split.MatrixSplit` over ``tp`` of a matrix under FSDP2
    over tensor parallelism (``None`` for any other layout): ``sharded`` mode's owner over
    ``dp`` holds this rank's whole ``tp`` shard (:func:`tensor_parallel_shape`, the split's
    ``local_shape``) and steps it with the owner's ``tp`` row."""
    if not is_dtensor(p) or p.dim() != 2:
        return None
    pl = placement_of(p, name)
    if not pl.sharded_split:
        return None
    _, d_tp, split = pl.sharded_split_dims
    return _matrix_split(p, d_tp, split, stats, local_shape=tensor_parallel_shape(p, name))


def _matrix_split(
    p: torch.Tensor,
    mesh_dim: int,
    tensor_dim: int,
    stats: CommStats | None,
    local_shape: tuple[int, int] | None = None,
) -> MatrixSplit:
    """``p`` split along ``tensor_dim`` over mesh dimension ``mesh_dim``: its ``reduce`` is an
    all-reduce over that dimension's group, waited under the deadline and counted."""
    stats = stats if stats is not None else default_stats()
    mesh = p.device_mesh  # type: ignore[attr-defined]
    group = mesh.get_group(mesh_dim)
    ranks = tuple(dist.get_process_group_ranks(group))
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    dim_name = str(names[mesh_dim])
    what = f"the Gram all-reduce of tensor-parallel matrices over mesh dim {dim_name!r}"

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        buf = t if t.is_contiguous() else t.contiguous()
        nbytes = buf.numel() * buf.element_size()
        stats.record_collective(STATS_NAME, "all_reduce", nbytes=nbytes, world_size=len(ranks))
        wait_work(dist.all_reduce(buf, op=_OPS[op], group=group, async_op=True), what, group)
        if buf is not t:
            t.copy_(buf)
        return t

    t = len(ranks)
    whole = int(p.shape[tensor_dim])
    me = int(mesh.get_local_rank(mesh_dim))
    gathered = f"the all-gather of tensor-parallel matrices over mesh dim {dim_name!r}"

    def gather(x: torch.Tensor) -> torch.Tensor:
        """The whole matrices of the batch ``x`` (``(B, rows, cols)`` shards): one padded
        all-gather along the split dimension (:func:`dmuon.comm.chunk_gather.all_gather_chunks`)."""
        d = x.dim() - 2 + tensor_dim
        return all_gather_chunks(
            x, d, whole, group, gathered, stats=stats, stats_name=GATHER_STATS_NAME
        )

    return MatrixSplit(
        dim=-2 if tensor_dim == 0 else -1,
        shape=(int(p.shape[0]), int(p.shape[1])),
        reduce=reduce,
        group=(dim_name, ranks),
        local_shape=local_shape,
        gather=gather,
        offset=shard_range(whole, t, me)[0],
        world_size=t,
    )


def check_split_groups(params: Iterable[EngineParam], group: Any, mode: str) -> None:
    """Refuse a split matrix (or expert stack) whose split crosses the group ``mode`` plans
    owners over.

    An owner's tensor-parallel row steps a split matrix together, so the ranks that
    hold its shards must be outside the planning group but for this rank: owners over
    ``dp``, shards over ``tp`` (``replicated`` mode; ``owner`` mode, whose planning group
    is its dedication's); the same for experts, held over ``ep``
    (:mod:`~dmuon.optim.engine.expert_split`). In ``owner`` mode an expert stack whose
    mesh spans exactly the planning group is taken too: each rank steps its experts where
    they live (:func:`~dmuon.optim.engine.expert_split.in_place_replicas`). FSDP2's rows
    (split over the planning group itself) are refused, naming the parameter, the two
    groups and what to pass. Every rank reads the same placements and groups, so every
    rank refuses alike.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    me = dist.get_rank()
    planning = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    for e in params:
        experts = expert_group_of(e)
        found = (split_group_of(e.param, e.name) or experts) if e.matrix else None
        if found is None:
            continue
        pl = placement_of_param(e)
        split = set(dist.get_process_group_ranks(found[1]))
        if split & planning == {me}:
            continue
        if (
            mode == "owner"
            and experts is not None
            and in_place_replicas(e.param, experts[0], planning) is not None
        ):
            continue  # a mesh over the dedication's ranks: stepped where they live
        if mode == "owner":
            raise ValueError(
                f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), "
                f"split over ranks {sorted(split)}; owner mode plans owners over ranks "
                f"{sorted(planning)} (the dedication's data-parallel group), and the two must "
                "cross in this rank alone. FSDP2's rows are stepped by mode='sharded' (no "
                "dedication); to have their owners step them, dedicate the model before "
                "fully_shard and pass ded.params to fully_shard(..., ignored_params=...); "
                "tensor-parallel matrices are dedicated over the 2-D dp × tp mesh"
            )
        raise ValueError(
            f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), split "
            f"over ranks {sorted(split)}; mode={mode!r} plans owners over ranks "
            f"{sorted(planning)}, and the two must cross in this rank alone (owners over the "
            "data-parallel ranks, shards over the tensor- or expert-parallel ones). Pass "
            "process_group=mesh['dp'].get_group() for a dp × tp (dp × ep) mesh; "
            + (
                "without data-parallel replicas of the experts, mode='single' does: each rank "
                "steps the experts it holds"
                if experts is not None
                else "FSDP2's rows are stepped by mode='sharded' (or mode='single', on the shards)"
            )
        )


def split_groups(params: Iterable[EngineParam]) -> list[dist.ProcessGroup]:
    """The distinct process groups the split matrices among ``params`` are split over.

    Their ranks must agree on a skipped step (a non-finite gradient on one rank's
    shard) before any of them enters a Gram all-reduce the others would not join.
    """
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for e in params:
        split = split_group_of(e.param, e.name) if e.matrix else None
        if split is not None:
            found.setdefault(tuple(dist.get_process_group_ranks(split[1])), split[1])
    return [found[k] for k in sorted(found)]


def tensor_groups(params: Iterable[EngineParam], group: Any) -> list[dist.ProcessGroup]:
    """The distinct process groups, other than the planning ``group``, whose ranks hold parts
    or copies of the matrices among ``params`` and must step them together: the groups the
    split matrices are split over (:func:`split_groups`), and the mesh dimensions a
    replicated-whole DTensor matrix
    (:attr:`~dmuon.optim.engine.placements.MatrixPlacement.replicated_whole`) is held over
    that cross ``group`` in this rank alone (its ``tp`` group beside owners over ``dp``).

    The owner's row carries out such a matrix's pending sum (``Partial``) with one
    all-reduce over that group after the reduction over ``dp``, so the row must agree on a
    skipped step first, and its gradient norm is counted once over the group.
    """
    params = list(params)
    found = {tuple(dist.get_process_group_ranks(g)): g for g in split_groups(params)}
    if not dist.is_available() or not dist.is_initialized():
        return [found[k] for k in sorted(found)]
    me = dist.get_rank()
    planning = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    for e in params:
        if not (e.matrix and e.param.dim() >= 2 and is_dtensor(e.param)):
            continue
        if not placement_of_param(e).replicated_whole:
            continue
        mesh = e.param.device_mesh  # type: ignore[attr-defined]
        for d in range(mesh.ndim):
            ranks = tuple(dist.get_process_group_ranks(mesh.get_group(d)))
            if len(ranks) > 1 and set(ranks) & planning == {me}:
                found.setdefault(ranks, mesh.get_group(d))
    return [found[k] for k in sorted(found)]


def laid_out_as(
    g: torch.Tensor,
    p: torch.Tensor,
    partial: bool = True,
    name: str = "",
    stats: CommStats | None = None,
) -> torch.Tensor:
    """The DTensor gradient ``g`` with the placements of its DTensor parameter ``p``
    (``g`` itself when they agree, or either is a plain tensor; with ``partial`` false,
    also a gradient with a pending sum, ``Partial``, whose local part is shaped like the
    parameter's: pending only over dimensions the parameter is replicated on, which is left to
    the step).

    DTensor's sharding propagation may hand the backward a gradient of other placements
    than the parameter's: a ``ColwiseParallel`` layer with fewer rows than ranks gets a
    ``Replicate()`` gradient of its ``Shard(0)`` weight, whose local part is the whole
    gradient, not the shard the engines step; a ``Shard(1)`` (rowwise) weight that meets
    a token-sharded DTensor activation is all-gathered by DTensor, and its gradient comes
    back ``Partial()``: each rank's local part is a whole-matrix partial sum.
    :func:`~dmuon.optim.engine.relayout.relaid` lays it out as ``p``: a local slice from
    ``Replicate()``, a collective of the group otherwise (a reduce-scatter from ``Partial``,
    an all-reduce to ``Replicate()``), waited under DMuon's deadline, named (``name``, the
    parameter's) in the error of a rank that does not come, and counted in ``stats``
    (default :func:`dmuon.comm.default_stats`) under
    :data:`~dmuon.optim.engine.relayout.PENDING_SUM_STATS_NAME`. A pending sum
    over a dimension the parameter is replicated on (a ``SequenceParallel`` norm's, or a
    replicated matrix's) has the parameter's local shape: owner mode reduces it over
    ``dp`` as it is (the sum over ``tp`` commutes with that reduction) and carries it out
    afterwards, on the owner's ``tp`` row only (``partial`` false); a pending sum over a
    dimension the parameter is split on has a local part of another shape, which cannot
    travel in the parameter's buckets, and is always laid out here."""
    if not is_dtensor(p) or not is_dtensor(g):
        return g
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    have = tuple(g.placements)  # type: ignore[attr-defined]
    if have == placements:
        return g
    # decided from the placements, the same on every rank (the local shapes are not: an
    # uneven split can give one rank the whole dimension, and it would skip a collective)
    pending = zip(have, placements, strict=True)
    if not partial and all(a == b or (a.is_partial() and b.is_replicate()) for a, b in pending):
        return g
    return relaid(g, placements, name, stats)


_RELAID = WeakIdKeyDictionary()
"""The parameters whose gradient was laid out anew (:func:`mark_relaid`)."""


def settle_split_grads(params: Iterable[EngineParam], stats: CommStats | None = None) -> None:
    """Lay the gradient of every DTensor parameter among ``params`` out as the parameter
    (:func:`laid_out_as`) before a step reads ``p.grad.to_local()`` as this rank's shard
    (its experts), or torch's in-place scalar steps meet a gradient of other placements
    than their parameter; a scalar's pending sum (``Partial``, a ``SequenceParallel``
    norm's) is left to its step (:func:`settle_pending_grads`). A redistribution that
    communicates is issued alike on every rank (placements are the same on every rank,
    and ``params`` in one order) and waited under DMuon's deadline
    (:func:`~dmuon.optim.engine.relayout.relaid`), its bytes counted in ``stats``
    (default :func:`dmuon.comm.default_stats`). The next backward gives such a
    parameter a gradient of the other placements again, which
    torch cannot add in place to the replaced one: ``DMuon.zero_grad`` drops it
    (:func:`drop_relaid_grads`) even with ``set_to_none=False``."""
    for e in params:
        g = e.param.grad
        if g is not None:
            settled = laid_out_as(g, e.param, partial=e.matrix, name=e.name, stats=stats)
            if settled is not g:
                e.param.grad = settled
                mark_relaid(e.param)


def settle_pending_grads(params: Iterable[torch.Tensor], stats: CommStats | None = None) -> None:
    """Carry out the pending sums (``Partial``) of the DTensor gradients of ``params``
    (:func:`~dmuon.optim.engine.relayout.summed`: an all-reduce under DMuon's deadline),
    before a scalar rule reads them: a ``SequenceParallel`` norm's weight, a bias that
    reads a token-sharded activation. Left to the rule, DTensor's arithmetic would carry
    each out by itself, once per operation that reads it, with no deadline. Every rank
    that steps them calls this with the same parameters in one order; the bytes are
    counted in ``stats`` (default :func:`dmuon.comm.default_stats`). Each one replaced
    is marked for ``DMuon.zero_grad`` to drop (:func:`drop_relaid_grads`)."""
    for p in params:
        g = p.grad
        if g is not None and is_dtensor(g):
            settle_pending_grad(p, g, stats=stats)


def settle_pending_grad(
    p: torch.Tensor, g: torch.Tensor, name: str = "", stats: CommStats | None = None
) -> torch.Tensor:
    """``p``'s gradient ``g`` with its pending sums (``Partial``) carried out
    (:func:`~dmuon.optim.engine.relayout.summed`, ``name`` the parameter's for its errors,
    the bytes counted in ``stats``), left in ``p.grad`` and marked for ``DMuon.zero_grad`` to
    drop (:func:`drop_relaid_grads`) when it was replaced, so that whatever reads it next
    (the norm of :func:`~dmuon.optim.clip_grad_norm_`, then the step) finds it settled and
    sums nothing again.

    Examples:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.ones(2)
        >>> settle_pending_grad(w, w.grad) is w.grad  # a plain gradient is final already
        True
    """
    settled = summed(g, name, stats)
    if settled is not g:
        p.grad = settled
        mark_relaid(p)
    return settled


def mark_relaid(p: torch.Tensor) -> None:
    """Note that ``p``'s gradient was laid out anew, with the parameter's placements
    (:func:`drop_relaid_grads`)."""
    _RELAID[p] = True


def drop_relaid_grads(params: Iterable[torch.Tensor]) -> None:
    """Set to ``None`` the gradients among ``params`` that :func:`settle_split_grads`
    replaced (zeroing them would leave the next backward a gradient of the parameter's
    placements to accumulate into, in place, which torch refuses)."""
    if not _RELAID:  # no gradient was laid out anew (no tensor parallelism): nothing to look up
        return
    for p in params:
        if _RELAID.pop(p, None) is not None:
            p.grad = None
