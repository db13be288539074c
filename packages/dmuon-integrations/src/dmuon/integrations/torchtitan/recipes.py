"""torchtitan trainer configs with DMuon, for ``--module dmuon.integrations.torchtitan.recipes``.

torchtitan's ``ConfigManager`` imports ``--module`` (a fully qualified module path
when it is not one of torchtitan's own) and calls the function named by
``--config``::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module dmuon.integrations.torchtitan.recipes --config llama3_debugmodel_dmuon

Each function is torchtitan's own debug recipe with the optimizer replaced by
:func:`~dmuon.integrations.torchtitan.dmuon_optimizer` (``sharded`` mode; Muon on
the matrices, DMuon's AdamW on embeddings, the output head and norms); every other
setting (data, schedule, parallelism, checkpointing) is torchtitan's and is
overridden on the command line as usual. Importing this module needs torchtitan's
trainer and its dependencies (``datasets``, ``tensorboard``, ``torchdata``, …),
which the ``[torchtitan]`` extra does not install: install torchtitan with its
dependencies to train.
"""

from __future__ import annotations

import dataclasses
import math

from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from dmuon.integrations.torchtitan.config import dmuon_optimizer
from dmuon.integrations.torchtitan.owners import parallelize_for_owners

__all__ = [
    "deepseek_v3_debugmodel_dmuon",
    "llama3_debugmodel_dmuon",
    "llama3_debugmodel_dmuon_owner",
]

LR = 8e-4
"""torchtitan's debug AdamW learning rate: DMuon's default ``adjust_lr="match_rms_adamw"``
scales Muon's update to AdamW's RMS, so the same value serves both."""
WEIGHT_DECAY = 0.1  # torchtitan's default_adamw


def llama3_debugmodel_dmuon() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` trained with DMuon (Muon, sharded mode).

    The fused ``wqkv`` is orthogonalised whole: torchtitan interleaves its rows per
    key/value head (``[n_kv_heads, heads_per_kv + 2, head_dim]``), which contiguous
    ``split_sizes`` cannot separate into q, k and v."""
    config = llama3_debugmodel()
    assert config.model_spec is not None
    config.optimizer = dmuon_optimizer(
        LR,
        weight_decay=WEIGHT_DECAY,
        adamw_weight_decay=WEIGHT_DECAY,
    )
    return config


def deepseek_v3_debugmodel_dmuon() -> Trainer.Config:
    """torchtitan's ``deepseek_v3_debugmodel`` (MoE) trained with DMuon (sharded mode):
    expert stacks ``(E, m, n)`` are batches of matrices, the router gate a matrix. With
    ``--parallelism.expert_parallel_degree`` > 1 each rank steps its own whole experts
    where they are (8 experts: at most 8 ``dp_shard × cp × tp`` ranks, beyond which
    torchtitan splits each expert's rows, which the container refuses)."""
    config = deepseek_v3_debugmodel()
    config.optimizer = dmuon_optimizer(
        LR, weight_decay=WEIGHT_DECAY, adamw_weight_decay=WEIGHT_DECAY
    )
    return config


def llama3_debugmodel_dmuon_owner() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` trained with DMuon in owner mode: each matrix
    whole on one owner rank (:mod:`~dmuon.integrations.torchtitan.owners`).

    Changed from torchtitan's recipe, as owner mode needs: the model spec's
    ``parallelize_fn`` is :func:`~dmuon.integrations.torchtitan.parallelize_for_owners`,
    the ``partial_dtensor`` backend, float32 parameters (the dedicated matrices are
    outside FSDP2's mixed-precision cast), no compile of the blocks, no CUDA graphs (a
    replay skips DMuon's hooks), and the clipping moved into the container
    (``training.max_norm`` = ∞, the container's ``max_norm`` = torchtitan's value): the
    trainer's own clip sees FSDP2's gradients only.
    """
    config = llama3_debugmodel()
    assert config.model_spec is not None
    config.model_spec = dataclasses.replace(
        config.model_spec, parallelize_fn=parallelize_for_owners
    )
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.mixed_precision_param = "float32"
    config.compile.enable = False
    config.training.disable_cuda_graphs = True
    max_norm = float(config.training.max_norm)
    config.training.max_norm = math.inf
    config.optimizer = dmuon_optimizer(
        LR,
        mode="owner",
        weight_decay=WEIGHT_DECAY,
        adamw_weight_decay=WEIGHT_DECAY,
    )
    config.optimizer.max_norm = max_norm
    return config
