"""DMuon without DDP: the same owner hooks replace DDP for the matrices.

The change to a DDP script is to *not* wrap the model and dedicate it instead::

    ded = dedicate(model)                                        # replaces DDP(model)
    opt = DMuon(param_groups(model), lr=1e-3, distributed=ded)

Each matrix's gradient is reduced to its owner (not all-reduced), only the owner
orthogonalises it, and the new weight is broadcast back — the traffic of DDP's
all-reduce, ``2(N−1)/N·P``, with the Newton–Schulz work divided by ``N``. The
scalar parameters (embeddings, head, norms, biases) are either all-reduced in
buckets from the same hooks and stepped on every rank (``scalars="all_reduce"``,
like DDP), or dedicated to owners too (``scalars="owner"``: the owner alone runs
AdamW on them and broadcasts the result, ZeRO-style).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import CommStats, collective_timeout, layer_key
from dmuon.comm.process_groups import group_size
from dmuon.integrations.buffers import broadcast_buffers as _broadcast_buffers
from dmuon.integrations.buffers import install_buffer_broadcast
from dmuon.integrations.dedication import Dedication, build_dedication, check_dedicate_arguments
from dmuon.integrations.selection import Predicate, mesh_groups, tensor_parallel_dim
from dmuon.optim.engine import DEFAULT_PACK_MB

__all__ = ["SCALAR_MODES", "dedicate"]

SCALAR_MODES = ("all_reduce", "owner")


def dedicate(
    model: nn.Module,
    group: Any = None,
    *,
    predicate: Predicate | None = None,
    scalars: str = "all_reduce",
    reshard_after_forward: bool = False,
    strategy: str = "lpt",
    layer_of: Callable[[str], str] = layer_key,
    layer_pack_mb: float = DEFAULT_PACK_MB,
    broadcast_buffers: bool = True,
    stats: CommStats | None = None,
    **plan_options: Any,
) -> Dedication:
    """Replace DDP for ``model``: matrices to owners, scalars all-reduced or owned.

    Call it on every rank, after the model is on its device, instead of
    ``DistributedDataParallel(model)``. Like DDP it starts every rank from rank 0's
    weights: the dedicated matrices, the all-reduced parameters and (with
    ``broadcast_buffers``) the buffers, so a checkpoint loaded on rank 0 alone reaches
    every rank.

    Args:
        model: the model (the same on every rank).
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh``; default the world. Or, for a
            model parallelised with ``parallelize_module`` on one dimension of it, the
            2-D ``dp × tp`` ``DeviceMesh``: owners are planned over the other dimension
            (the rule: :func:`~dmuon.integrations.selection.tensor_parallel_dim`), by
            the whole matrices' shapes, and each owner's ``tp`` row steps the shards
            together (:mod:`dmuon.optim.engine.owner_split`). The tensor-parallel
            scalars (biases, norms) are all-reduced over ``dp`` by their local parts.
        predicate: ``(name, param) → bool`` choosing the dedicated matrices
            (default: the matrices of :func:`dmuon.optim.param_groups`).
        scalars: ``"all_reduce"`` (bucketed all-reduce from the hooks; every rank
            steps them) or ``"owner"`` (dedicated too: sharded AdamW state).
        reshard_after_forward: ZeRO-3-like: keep only the owned dedicated weights
            between layers (see :func:`dmuon.integrations.fsdp.dedicate`).
        strategy: owner planning strategy (see :func:`dmuon.comm.plan_owners`).
        layer_of: name → layer key (the unit of reduction and publication).
        layer_pack_mb: consecutive layers whose parameters hold at most this many MiB
            together are reduced and published as one unit (one collective per owner and
            pack, not per owner and layer: on a model of many small layers the
            collectives' latency bounds the step); default 1 MiB (DDP's first bucket),
            ``0``: every layer alone. Ignored (layers alone) with
            ``reshard_after_forward`` or tensor-parallel parameters.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to every
            rank here and before every forward run with gradients enabled, as DDP does
            by default (:mod:`dmuon.integrations.buffers`); ``False``: each rank keeps
            its own.
        stats: where bytes are recorded.
        **plan_options: more arguments of :func:`dmuon.comm.plan_owners`.

    Returns:
        The :class:`~dmuon.integrations.Dedication`.

    Raises:
        ValueError: a bad ``scalars`` or group.
        TypeError: ``model`` not an ``nn.Module`` (``dedicate(model.parameters())``),
            ``predicate``/``layer_of`` not callable, ``layer_of`` returning something
            other than a str, ``stats`` neither ``None`` nor a ``CommStats``.
        dmuon.optim.ModelMismatchError: the ranks' models differ.

    Examples:
        >>> import torch
        >>> from dmuon.integrations.ddp import dedicate
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        >>> ded = dedicate(model)
        >>> ded.names, ded.all_reduced
        (('0.weight', '1.weight'), ('0.bias', '1.bias'))
    """
    check_dedicate_arguments(model, predicate=predicate, layer_of=layer_of, stats=stats)
    if scalars not in SCALAR_MODES:
        raise ValueError(f"scalars must be one of {SCALAR_MODES}, got {scalars!r}")
    tp_dim = tensor_parallel_dim(group, model)
    pg, replicate = mesh_groups(group) if tp_dim is None else (group.get_group(1 - tp_dim), None)
    if replicate is not None:
        raise ValueError(
            "ddp.dedicate takes a 1-D group, or the 2-D dp × tp mesh of a tensor-parallel model "
            "(its DTensors split over one dimension of it); for HSDP use "
            "dmuon.integrations.fsdp.dedicate with the 2-D mesh and FSDP2 for the scalar "
            "parameters"
        )
    ded = build_dedication(
        model,
        group if tp_dim is not None else pg,
        predicate=predicate,
        strategy=strategy,
        layer_of=layer_of,
        layer_pack_mb=layer_pack_mb,
        stats=stats,
        all_reduce_rest=scalars == "all_reduce",
        kind="ddp",
        plan_options=plan_options,
        dedicate_rest=scalars == "owner",
        reshard_after_forward=reshard_after_forward,
        experts_in_place=True,
    )
    if broadcast_buffers and group_size(pg) > 1:
        with collective_timeout(ded.exchange.publication.timeout):
            _broadcast_buffers(model, pg)

        def buffers() -> list[RemovableHandle]:
            handle = install_buffer_broadcast(model, pg, lambda: ded.exchange.publication.timeout)
            return [] if handle is None else [handle]

        ded.add_hooks(buffers)
    return ded
