"""A DTensor gradient laid out anew — its pending sums carried out, its shard cut — by
collectives DMuon issues itself, under its deadline.

DTensor's ``redistribute`` runs its collectives as functional collectives whose wait
has no deadline: a rank that never arrives (it crashed in a way its peers cannot see,
it took another branch, it stalls) holds the others until the process group's own
timeout — gloo's default is 30 minutes — and the error names no collective. DMuon's
rule is that nothing it waits for is untimed, so the few changes of layout its
engines make to a tensor-parallel gradient are made here, one mesh dimension at a
time:

=====================  =====================  ==============================================
gradient on the dim    parameter on the dim   what the ranks of the dim's group do
=====================  =====================  ==============================================
``Partial()``          ``Replicate()``        one all-reduce of the local parts
``Partial()``          ``Shard(d)``           one reduce-scatter along ``d`` (every block
                                              padded to ``⌈size/t⌉``, as ``torch.chunk``;
                                              under gloo an all-reduce, whose wait honours
                                              the deadline, and this rank's block)
``Replicate()``        ``Shard(d)``           each keeps its chunk (no collective)
=====================  =====================  ==============================================

Each collective is issued with ``async_op=True`` and waited by
:func:`dmuon.comm.wait_work` within the deadline of the enclosing
:func:`dmuon.comm.collective_timeout` (``DMuon(timeout=...)`` inside a step): a rank that
does not come makes the others raise :class:`dmuon.comm.CollectiveError` naming the
collective, the parameter and the mesh dimension. These are the collectives
``redistribute`` issues for the same change, on the same local tensors, in the same
order of mesh dimensions, so the results are the same. Any other change of layout (a
shard gathered, moved to another dimension, two mesh dimensions sharding one tensor
dimension) is refused, naming the placements: DMuon's engines make none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import CommStats, default_stats, shard_range, wait_work
from dmuon.comm.chunk_gather import padded_chunks
from dmuon.comm.torch_compat import reduce_scatter_single
from dmuon.optim.engine.params import is_dtensor

__all__ = ["PENDING_SUM_STATS_NAME", "relaid", "summed"]

PENDING_SUM_STATS_NAME = "tensor_parallel_pending_sum"
"""The name under which :class:`dmuon.comm.CommStats` counts the collectives that carry
out a tensor-parallel gradient's pending sums (:func:`relaid`, :func:`summed`)."""

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def relaid(
    g: torch.Tensor, placements: Sequence[Any], name: str = "", stats: CommStats | None = None
) -> torch.Tensor:
    """The DTensor ``g`` with ``placements`` (on its own mesh), made by the changes of the
    module's table, each collective waited under the current deadline.

    Args:
        g: a DTensor (a gradient).
        placements: the placements wanted, one per mesh dimension.
        name: the parameter's name, for the errors (``""``: unnamed).
        stats: where the collectives' bytes are counted (:data:`PENDING_SUM_STATS_NAME`);
            default :func:`dmuon.comm.default_stats`.

    Raises:
        dmuon.comm.CollectiveError: a collective failed or did not finish in time.
        NotImplementedError: a change of layout the table does not list.
    """
    from torch.distributed.tensor import DTensor

    mesh = g.device_mesh  # type: ignore[attr-defined]
    have = list(g.placements)  # type: ignore[attr-defined]
    want = tuple(placements)
    if len(want) != len(have):
        raise ValueError(
            f"placements {want} name {len(want)} mesh dimensions; the gradient of "
            f"{name or 'a parameter'!r} lives on {len(have)}"
        )
    # DTensor's order: from the inner mesh dimension out when the gradient is sharded
    # somewhere (its nested shards), from the outer in otherwise (the sums' order, bitwise)
    sharded = any(pl.is_shard() and mesh.size(d) > 1 for d, pl in enumerate(have))
    order = reversed(range(len(have))) if sharded else range(len(have))
    local = g.to_local()  # type: ignore[attr-defined]
    stats = stats if stats is not None else default_stats()
    with torch.no_grad():
        for d in order:
            if have[d] == want[d]:
                continue
            local = _change(local, have, want, d, mesh, name, stats)
            have[d] = want[d]
    return DTensor.from_local(local, mesh, want, run_check=False, shape=g.shape, stride=g.stride())


def summed(g: torch.Tensor, name: str = "", stats: CommStats | None = None) -> torch.Tensor:
    """A DTensor gradient with its pending sums (``Partial``) carried out: what a
    ``SequenceParallel`` norm's weight gets, each rank's sum over its part of the
    sequence. Its local part is not a part of the gradient until the group has added
    them (one all-reduce per pending mesh dimension, under DMuon's deadline:
    :func:`relaid`; ``name``, the parameter's, for its errors; ``stats``, where its bytes are
    counted); other gradients are returned as they are."""
    if not is_dtensor(g):
        return g
    placements = tuple(g.placements)  # type: ignore[attr-defined]
    if not any(pl.is_partial() for pl in placements):
        return g
    from torch.distributed.tensor import Replicate

    settled = [Replicate() if pl.is_partial() else pl for pl in placements]
    return relaid(g, settled, name, stats)


def _change(
    local: torch.Tensor,
    have: list[Any],
    want: tuple[Any, ...],
    d: int,
    mesh: Any,
    name: str,
    stats: CommStats,
) -> torch.Tensor:
    """``local`` after the change of mesh dimension ``d`` from ``have[d]`` to ``want[d]``."""
    src, dst = have[d], want[d]
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    where = f"over mesh dim {names[d]!r}"
    of = f"the pending sum (Partial) of {name!r}" if name else "a pending sum (Partial)"
    plain_partial = type(src).__name__ == "Partial" and src.reduce_op in (*_OPS, "avg")
    alone = dst.is_shard() and not any(
        i != d and (pl.is_shard(dst.dim) or q.is_shard(dst.dim))
        for i, (pl, q) in enumerate(zip(have, want, strict=True))
    )
    group = mesh.get_group(d)
    t = int(mesh.size(d))
    if plain_partial and dst.is_replicate():
        # a copy: the all-reduce works in place, and the gradient handed in stays a pending sum
        out = local.clone(memory_format=torch.contiguous_format)
        op = _OPS.get(src.reduce_op, dist.ReduceOp.SUM)
        if t > 1:
            nbytes = out.numel() * out.element_size()
            stats.record_collective(
                PENDING_SUM_STATS_NAME, "all_reduce", nbytes=nbytes, world_size=t
            )
            work = dist.all_reduce(out, op=op, group=group, async_op=True)
            wait_work(work, f"the all-reduce of {of} {where}", group)
        return out / t if src.reduce_op == "avg" else out
    if (plain_partial or src.is_replicate()) and alone:
        dim = dst.dim % local.dim()
        size = int(local.shape[dim])
        me = int(mesh.get_local_rank(d))
        if src.is_replicate() or t == 1:
            return local.narrow(dim, *shard_range(size, t, me)).contiguous()
        what = f"the reduce-scatter of {of} {where}"
        return _reduce_scatter(local, dim, src.reduce_op, group, t, me, what, stats)
    raise NotImplementedError(
        f"the gradient of {name or 'a parameter'!r} is laid out {tuple(have)} and must become "
        f"{want} on mesh dims {tuple(names)}: DMuon changes {src} to {dst} on mesh dim "
        f"{names[d]!r} only for a pending sum (Partial(sum/avg/max/min)) made replicated or "
        "sharded, or a replicated gradient cut to its shard, with no other mesh dimension "
        "sharding the same tensor dimension"
    )


def _reduce_scatter(
    local: torch.Tensor,
    dim: int,
    reduce_op: str,
    group: Any,
    t: int,
    me: int,
    what: str,
    stats: CommStats,
) -> torch.Tensor:
    """This rank's chunk along ``dim`` (``torch.chunk``'s) of the sum over ``group`` of the
    ranks' ``local``: every chunk padded to the largest, stacked along dim 0, one
    reduce-scatter (what DTensor's ``Partial`` → ``Shard`` does), the padding cut off."""
    size = int(local.shape[dim])
    padded = padded_chunks(local, dim, t)  # (t, *block)
    block = padded.shape[1:]
    send = padded.view(t * block[0], *block[1:])  # the blocks one after another along dim 0
    op = _OPS.get(reduce_op, dist.ReduceOp.SUM)
    rows = int(block[0])
    nbytes = send.numel() * send.element_size()  # the t padded blocks, as either sends
    if dist.get_backend(group) == "gloo":
        # gloo's reduce-scatter ignores its wait's timeout (torch 2.13: a peer 4 s late held
        # a 1 s wait for 4 s; its all-reduce raised at 1 s), and its result is the all-reduce's
        # block, bitwise: the all-reduce, then this rank's block
        stats.record_collective(PENDING_SUM_STATS_NAME, "all_reduce", nbytes=nbytes, world_size=t)
        work = dist.all_reduce(send, op=op, group=group, async_op=True)
        wait_work(work, what, group)
        out = send.narrow(0, me * rows, rows)
    else:
        out = local.new_empty(block)
        stats.record_collective(
            PENDING_SUM_STATS_NAME, "reduce_scatter", nbytes=nbytes, world_size=t
        )
        work = reduce_scatter_single(out, send, op=op, group=group, async_op=True)
        wait_work(work, what, group)
    out = out / t if reduce_op == "avg" else out
    return out.narrow(dim, 0, shard_range(size, t, me)[1]).contiguous()
