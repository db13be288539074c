"""What the DeepSpeed integration tests share: the skip marker, the cases, the config."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from distributed_cases import GLOBAL_BATCH

from dmuon.integrations import deepspeed as dmuon_ds  # imports without DeepSpeed

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed: pip install 'dmuon-integrations[deepspeed]'",
)

# Every (ZeRO stage, mode) DMuon serves under DeepSpeed.
CASES = [(stage, mode) for stage, modes in dmuon_ds.SUPPORTED.items() for mode in modes]


def deepspeed_config(stage: int, world: int, accumulate: int = 1, **extra: Any) -> dict:
    """The global batch of distributed_cases in ``accumulate`` micro-batches per rank."""
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world * accumulate),
        "gradient_accumulation_steps": accumulate,
        "zero_optimization": {"stage": stage},
        **extra,
    }
