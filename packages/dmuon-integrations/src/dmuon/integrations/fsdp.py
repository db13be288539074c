"""DMuon with FSDP2: dedicate the matrices to owners, let ``fully_shard`` take the rest.

The three-line change to an FSDP2 script::

    ded = dedicate(model, mesh)                                   # 1
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)  # 2
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), lr=1e-3, distributed=ded)    # 3

FSDP2 shards and synchronises the embeddings, head, norms and biases as usual
(they take AdamW inside DMuon); each dedicated matrix is whole on its owner, its
gradient is reduced to the owner from a hook per layer during backward, the owner
steps it, and the new weight is broadcast back and waited in that layer's next
forward. No FSDP2 internals are touched: ``ignored_params`` is its public way to
leave parameters alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from dmuon.comm import CommStats, layer_key
from dmuon.integrations.dedication import Dedication, build_dedication
from dmuon.integrations.selection import Predicate
from dmuon.optim.engine import DEFAULT_PACK_MB

__all__ = ["dedicate"]


def dedicate(
    model: nn.Module,
    mesh: Any = None,
    *,
    predicate: Predicate | None = None,
    reshard_after_forward: bool = False,
    reduce_op: str = "avg",
    free_local_grads: bool = False,
    strategy: str = "lpt",
    layer_of: Callable[[str], str] = layer_key,
    layer_pack_mb: float = DEFAULT_PACK_MB,
    stats: CommStats | None = None,
    **plan_options: Any,
) -> Dedication:
    """Give every matrix of ``model`` an owner rank and install DMuon's hooks (FSDP2).

    Call it on every rank, after the model is on its device and before
    ``fully_shard``; pass ``ded.params`` to ``fully_shard(..., ignored_params=...)``.

    It plans owners with :func:`dmuon.comm.plan_owners` (by Newton–Schulz cost;
    same-layer matrices on different ranks), checks that every rank built the same
    model (a mismatch raises on every rank, naming the parameter, before any other
    collective), gives every rank rank 0's dedicated weights (``fully_shard`` takes the
    others from each rank's own copy), and hooks the model:
    gradient reduction to owners per layer from post-accumulate-grad hooks, and a
    forward pre-hook per layer that waits for the layer's published weights.

    Args:
        model: the model (the same on every rank).
        mesh: a 1-D ``DeviceMesh`` (FSDP), a 2-D one (HSDP: replicate × shard), a
            ``ProcessGroup``, or ``None`` (the world). A 2-D ``dp × tp`` mesh of a model
            parallelised with ``parallelize_module`` on one of its dimensions is not
            HSDP: owners are planned over the other one (the rule:
            :func:`~dmuon.integrations.selection.tensor_parallel_dim`) and each owner's
            ``tp`` row steps the shards (:mod:`dmuon.optim.engine.owner_split`); shard
            the rest with ``fully_shard(model, mesh=mesh["dp"], ignored_params=...)``.
        predicate: ``(name, param) → bool`` choosing the dedicated parameters;
            default the matrices of :func:`dmuon.optim.param_groups` (hidden weights,
            conv weights, expert stacks).
        reshard_after_forward: ZeRO-3-like: a rank keeps only the matrices it owns
            and the others are broadcast around each layer's forward and backward
            (3(N−1)/N·P bytes per step instead of 2(N−1)/N·P); default ZeRO-2-like,
            every matrix resident. 1-D meshes of plain tensors only. Every rank must
            run every dedicated layer: the end of each training forward of ``model``
            itself checks it (:class:`~dmuon.integrations.PartialUseError` on every
            rank otherwise; a loop that calls only its submodules, as a Lightning
            ``training_step`` may, goes unchecked).
        reduce_op: how the dedicated gradients are combined over the ranks, to match
            FSDP2's for the rest: ``"avg"`` (FSDP2's default: the mean) or ``"sum"``
            (after ``set_gradient_divide_factor(1.0)`` on the FSDP2 modules, as
            torchtitan does because it divides the loss by the global token count).
        free_local_grads: set a dedicated matrix's local ``p.grad`` to ``None`` once it
            is copied for its reduction, as FSDP2 frees the unsharded gradients: less
            memory in backward, and no plain-tensor gradient beside FSDP2's DTensor ones
            when a trainer takes the norm of every ``p.grad`` itself (torchtitan). The
            same for an expert stack replicated over ``dp`` (``dp × ep``) once it is
            copied for its reduction to its owner among the replicas (a stack on ``ep``
            alone keeps its gradient: it is final). The owners' reduced gradients are set
            in ``step()`` as always.
        strategy: owner planning strategy (``"lpt"`` or ``"ilp"``; see
            :func:`dmuon.comm.plan_owners`).
        layer_of: name → layer key; a layer is the unit of reduction, publication and
            pipelining (default :func:`dmuon.comm.layer_key`: ``blocks.3``).
        layer_pack_mb: consecutive layers whose parameters hold at most this many MiB
            together are reduced and published as one unit (one collective per owner and
            pack, not per owner and layer: on a model of many small layers the
            collectives' latency bounds the step); default 1 MiB (DDP's first bucket),
            ``0``: every layer alone. Ignored (layers alone) with
            ``reshard_after_forward`` or tensor-parallel parameters.
        stats: where bytes are recorded (default :func:`dmuon.comm.default_stats`).
        **plan_options: more arguments of :func:`dmuon.comm.plan_owners`.

    Returns:
        The :class:`~dmuon.integrations.Dedication`.

    Raises:
        ValueError: a bad mesh, a ``reduce_op`` other than ``"avg"``/``"sum"``, or no
            parameter to dedicate.
        RuntimeError: a process ``torchrun`` started (``WORLD_SIZE`` > 1) that has not
            called ``init_process_group``.
        dmuon.optim.ModelMismatchError: the ranks' models differ.

    Examples:
        >>> import torch
        >>> from dmuon.integrations.fsdp import dedicate
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        >>> ded = dedicate(model)  # one process: the world of one rank owns everything
        >>> sorted(ded.params, key=lambda p: p.shape) == sorted(
        ...     [model[1].weight, model[0].weight], key=lambda p: p.shape)
        True
    """
    ded = build_dedication(
        model,
        mesh,
        predicate=predicate,
        strategy=strategy,
        layer_of=layer_of,
        layer_pack_mb=layer_pack_mb,
        stats=stats,
        reshard_after_forward=reshard_after_forward,
        reduce_op=reduce_op,
        free_local_grads=free_local_grads,
        all_reduce_rest=False,
        kind="fsdp",
        plan_options=plan_options,
        experts_in_place=True,
        check_rest_use=True,  # FSDP2 synchronises the rest (partial_use.py)
    )
    return ded
