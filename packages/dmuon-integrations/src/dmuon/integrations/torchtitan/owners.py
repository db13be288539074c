"""Owner mode in torchtitan: FSDP2 leaves the matrices to their owners.

Owner mode keeps every dedicated matrix whole on its owner rank, reduces its gradient
there and broadcasts the stepped weight back (:func:`dmuon.integrations.fsdp.dedicate`).
FSDP2 must therefore leave those matrices alone (``fully_shard(...,
ignored_params=...)``) when it shards the model, and in torchtitan that happens in the
model spec's ``parallelize_fn``, on a meta-device model, before any weight exists.
The work is split in two:

* :func:`parallelize_for_owners` is the ``parallelize_fn``. It does what torchtitan's
  ``parallelize_llama`` does on its ``partial_dtensor`` path — tensor parallelism
  (``model.parallelize``), activation checkpointing — then FSDP2 in torchtitan's units
  (the embedding, every block, the norm with the head, the root) with the matrices
  DMuon will dedicate (those of
  :func:`dmuon.optim.param_groups`) in ``ignored_params``, FSDP2's mixed-precision policy
  and reshard-after-forward policy as torchtitan sets them, and FSDP2's gradient division
  off, as torchtitan does: its loss is each rank's token sum divided by the *global*
  token count, so the gradients are summed over the ranks. It records, per model, the
  names it left out and the mesh to plan owners on.
* :class:`~dmuon.integrations.torchtitan.DMuonOptimizersContainer` with
  ``mode="owner"``, which the trainer builds after ``init_weights``, calls
  :func:`dedicate_for_owners`: :func:`~dmuon.integrations.fsdp.dedicate` over that mesh
  with ``reduce_op="sum"`` (every rank gets rank 0's initialised weights, the
  hooks are installed) and a check that the dedicated matrices are exactly the ones
  FSDP2 left out.

With gradient accumulation (``training.global_batch_size`` over several local batches)
the owners' reductions run in the last micro-batch's backward only, the earlier ones
accumulating locally: torchtitan calls no ``no_sync``, so the forwards are counted.

Refused, each with an error naming the setting: the ``full_dtensor``/``spmd_types``
backends (their parameters are DTensors over the whole mesh, not plain tensors FSDP2
can leave out), context, pipeline and expert parallelism, HSDP together with tensor
parallelism or with one ``dp_shard`` rank, ``torch.compile`` of the blocks (torchtitan
compiles each block with ``fullgraph=True``; DMuon's per-layer hooks are graph breaks),
CUDA graphs (a replay skips the hooks), CPU offload, FSDP2 symmetric memory, a finite
``training.max_norm`` (the trainer's clip would see FSDP2's gradients only: clip in the
container) and bf16 parameters (``training.mixed_precision_param``: the dedicated
matrices live outside FSDP2's mixed-precision cast, so the activations must stay float32
to meet them).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from dmuon.integrations.dedication import Dedication
from dmuon.integrations.selection import split_parameters

__all__ = ["OwnerLayout", "dedicate_for_owners", "owner_layout", "parallelize_for_owners"]


@dataclass(frozen=True)
class OwnerLayout:
    """What :func:`parallelize_for_owners` did to a model, for the container.

    Attributes:
        names: the parameters FSDP2 left out (``ignored_params``), by name.
        mesh: the mesh owners are planned on: the ``fsdp`` mesh (HSDP: ``dp_replicate ×
            fsdp``), or ``fsdp × tp`` with tensor parallelism (owners over ``fsdp``, each
            owner's ``tp`` row stepping the shards).
        accumulation: torchtitan's gradient-accumulation steps (micro-batches per
            optimizer step): the owners' reductions run after the last one's backward.
    """

    names: frozenset[str]
    mesh: Any
    accumulation: int = 1


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, OwnerLayout] = weakref.WeakKeyDictionary()


def owner_layout(model: nn.Module) -> OwnerLayout | None:
    """The :class:`OwnerLayout` :func:`parallelize_for_owners` recorded for ``model``
    (``None``: it was not parallelised for owner mode)."""
    return _LAYOUTS.get(model)


def _refuse_unsupported(parallel_dims: Any, training: Any, parallelism: Any, compile_config: Any):
    def no(setting: str, why: str) -> ValueError:
        return ValueError(
            f"{setting}: {why} (dmuon.integrations.torchtitan.parallelize_for_owners)"
        )

    backend = getattr(parallelism, "spmd_backend", "partial_dtensor")
    if backend != "partial_dtensor":
        raise no(
            f"parallelism.spmd_backend={backend!r}",
            "owner mode needs the 'partial_dtensor' backend (DTensors on the model-parallel "
            "axes only), where the dedicated matrices stay plain tensors FSDP2 can leave out; "
            "set --parallelism.spmd_backend partial_dtensor, or use mode='sharded'",
        )
    for flag, name in (("cp_enabled", "context"), ("pp_enabled", "pipeline")):
        if getattr(parallel_dims, flag, False):
            raise no(f"{name} parallelism", "not supported in owner mode; use mode='sharded'")
    if getattr(parallel_dims, "ep_enabled", False):
        raise no(
            "expert parallelism",
            "owner mode dedicates whole matrices; expert stacks split over 'ep' are stepped "
            "by mode='sharded'",
        )
    if parallel_dims.tp_enabled and parallel_dims.dp_replicate_enabled:
        raise no(
            "HSDP (data_parallel_replicate_degree > 1) with tensor parallelism",
            "owner mode plans owners over one data-parallel dimension beside 'tp'",
        )
    if (
        compile_config is not None
        and compile_config.enable
        and "model" in getattr(compile_config, "components", ("model",))
    ):
        raise no(
            "compile.enable with the 'model' component",
            "torchtitan compiles each block with fullgraph=True and DMuon's per-layer "
            "forward hooks are graph breaks; train owner mode eagerly, or use mode='sharded'",
        )
    if not getattr(training, "disable_cuda_graphs", True):
        raise no(
            "training.disable_cuda_graphs=False",
            "torchtitan would capture forward and backward in a CUDA graph, and a replay "
            "skips DMuon's hooks (no reduction to the owners, no broadcast back); set "
            "--training.disable_cuda_graphs",
        )
    if getattr(training, "enable_cpu_offload", False):
        raise no(
            "training.enable_cpu_offload",
            "FSDP2 offloads the parameters it shards only; the dedicated matrices would stay "
            "on the CPU beside the GPU collectives",
        )
    max_norm = float(getattr(training, "max_norm", math.inf))
    if math.isfinite(max_norm):
        raise no(
            f"training.max_norm={max_norm:g}",
            "torchtitan's own clip would see FSDP2's gradients only (the dedicated ones are "
            "reduced in the optimizer step); set --training.max_norm inf and clip with the "
            f"container's --optimizer.max_norm {max_norm:g} instead",
        )
    if parallel_dims.dp_replicate_enabled and not getattr(parallel_dims, "dp_shard_enabled", True):
        raise no(
            "data_parallel_replicate_degree > 1 with data_parallel_shard_degree 1",
            "owner mode plans owners over the fsdp (dp_shard) dimension, which has one rank "
            "here; use data_parallel_shard_degree > 1, or plain replication (DDP) with "
            "dmuon.integrations.ddp.dedicate",
        )
    if getattr(parallelism, "enable_fsdp_symm_mem", False):
        raise no(
            "parallelism.enable_fsdp_symm_mem",
            "not supported with the FSDP2 units parallelize_for_owners builds",
        )
    param_dtype = getattr(training, "mixed_precision_param", "float32")
    if param_dtype != "float32":
        raise no(
            f"training.mixed_precision_param={param_dtype!r}",
            "the dedicated matrices are outside FSDP2's mixed-precision cast, so every "
            "parameter must compute in float32 (set --training.mixed_precision_param float32)",
        )


def parallelize_for_owners(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any = None,
    ac_config: Any = None,
    dump_folder: str = "",
) -> nn.Module:
    """A torchtitan ``parallelize_fn`` for DMuon's owner mode (module docstring).

    Set it on the model spec (``config.model_spec.parallelize_fn``) and build the
    optimizer with ``dmuon_optimizer(mode="owner")``; the recipe
    ``llama3_debugmodel_dmuon_owner`` does both.

    Args:
        model: the decoder (``tok_embeddings``, ``layers``, ``norm``, ``lm_head``), on the
            meta device or materialised.
        parallel_dims: torchtitan's ``ParallelDims`` (``get_mesh``, ``tp_enabled``, …).
        training: torchtitan's ``TrainingConfig`` (mixed precision, CPU offload).
        parallelism: torchtitan's ``ParallelismConfig`` (backend, reshard policy).
        compile_config: torchtitan's ``CompileConfig`` (must not compile the model).
        ac_config: torchtitan's activation-checkpointing config, applied as torchtitan does.
        dump_folder: passed to the activation-checkpointing config.

    Returns:
        The model, parallelised.

    Raises:
        ValueError: a setting owner mode does not support (module docstring), named.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.fsdp import (
        disable_fsdp_gradient_division,
        get_fsdp_reshard_after_forward_policy,
    )

    _refuse_unsupported(parallel_dims, training, parallelism, compile_config)
    if parallel_dims.tp_enabled:
        model.parallelize(parallel_dims)  # type: ignore[operator]
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_mesh(names)
    owner_mesh = parallel_dims.get_mesh(["fsdp", "tp"]) if parallel_dims.tp_enabled else dp_mesh
    dedicated, _ = split_parameters(model)
    ignored = {p for _, p in dedicated}
    config: dict[str, Any] = {
        "mesh": dp_mesh,
        "ignored_params": ignored,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            cast_forward_inputs=False,
        ),
    }
    policy = parallelism.fsdp_reshard_after_forward
    reshard = get_fsdp_reshard_after_forward_policy(policy, parallel_dims.pp_enabled)
    # torchtitan's units (apply_fsdp_to_decoder): the embedding, each block, the norm with
    # the head (not resharded after forward by default: FSDP2 would prefetch them at once),
    # then the root; with tied weights, the embedding, norm and head as one unit
    embedding = getattr(model, "tok_embeddings", None)
    last = [
        m for m in (getattr(model, "norm", None), getattr(model, "lm_head", None)) if m is not None
    ]
    if getattr(model, "enable_weight_tying", False):
        fully_shard(
            [m for m in (embedding, *last) if m is not None],
            reshard_after_forward=policy == "always",
            **config,
        )
    else:
        if embedding is not None:
            fully_shard(embedding, reshard_after_forward=reshard, **config)
        if len(last) == 2:
            fully_shard(last, reshard_after_forward=policy == "always", **config)
    for block in model.layers.values():  # type: ignore[operator]
        fully_shard(block, reshard_after_forward=reshard, **config)
    fully_shard(model, **config)
    disable_fsdp_gradient_division(model)  # torchtitan's convention: gradients summed
    _LAYOUTS[model] = OwnerLayout(
        frozenset(item.name for item, _ in dedicated),
        owner_mesh,
        _accumulation_steps(parallel_dims, training),
    )
    return model


def _accumulation_steps(parallel_dims: Any, training: Any) -> int:
    """torchtitan's ``gradient_accumulation_steps``: the global batch over the local batch
    times the batch (data-parallel) degree; 1 when the global batch is not set."""
    degree = parallel_dims.get_mesh("batch").size() if parallel_dims.dp_enabled else 1
    local = int(getattr(training, "local_batch_size", 1))
    global_ = int(getattr(training, "global_batch_size", -1))
    return max(1, global_ // (local * degree)) if global_ > 0 else 1


def dedicate_for_owners(model: nn.Module, **dedicate_options: Any) -> Dedication:
    """Dedicate the matrices :func:`parallelize_for_owners` left out of FSDP2.

    :func:`dmuon.integrations.fsdp.dedicate` on the recorded mesh with
    ``reduce_op="sum"`` (torchtitan sums gradients over the ranks) and
    ``free_local_grads=True`` (torchtitan's trainer takes the norm of every ``p.grad``
    before the step; the dedicated ones are gone by then, so it sees FSDP2's DTensor
    gradients only), after the weights are initialised: every rank takes the owners'
    weights. Collective.

    Raises:
        ValueError: ``model`` was not parallelised by :func:`parallelize_for_owners`, or
            the matrices DMuon dedicates differ from those FSDP2 left out (named).
    """
    from dmuon.integrations.fsdp import dedicate

    layout = owner_layout(model)
    if layout is None:
        raise ValueError(
            "mode='owner' in torchtitan needs the model parallelised by "
            "dmuon.integrations.torchtitan.parallelize_for_owners (FSDP2 must leave the "
            "dedicated matrices out): set it as the model spec's parallelize_fn, as the recipe "
            "llama3_debugmodel_dmuon_owner does, or use mode='sharded'"
        )
    ded = dedicate(model, layout.mesh, reduce_op="sum", free_local_grads=True, **dedicate_options)
    names = set(ded.names)
    if names != layout.names:
        ded.undedicate()  # the matrices let go too: a corrected model can be dedicated again
        extra = sorted(names - layout.names)[:4]
        missing = sorted(layout.names - names)[:4]
        raise ValueError(
            "the matrices dedicated to owners differ from those FSDP2 left out in "
            f"parallelize_for_owners (dedicated but sharded by FSDP2: {extra}; left out but "
            f"not dedicated: {missing}): the model's trainable matrices changed in between "
            "(parameters frozen, added or replaced after parallelize_fn)"
        )
    if layout.accumulation > 1:
        ded.add_hooks(lambda: [_reduce_after_last_micro_batch(model, ded, layout.accumulation)])
    return ded


def _reduce_after_last_micro_batch(model: nn.Module, ded: Dedication, steps: int) -> Any:
    """torchtitan runs ``steps`` forward/backward pairs per optimizer step, without
    ``no_sync``: count the training forwards (gradients enabled) and let the owners'
    reductions run only in the backward of every ``steps``-th, the others accumulating
    locally (FSDP2 itself reduce-scatters every micro-batch, as torchtitan has it)."""
    import torch

    forwards = [0]

    def count(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            forwards[0] += 1

    handle = model.register_forward_pre_hook(count)
    ded.exchange.reduction.set_sync_condition(lambda: forwards[0] % steps == 0)
    return handle
