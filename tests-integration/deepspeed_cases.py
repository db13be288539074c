"""What the DeepSpeed integration tests share: the skip marker, the cases, the config."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest
from distributed_cases import GLOBAL_BATCH

from dmuon.integrations import deepspeed as dmuon_ds  # imports without DeepSpeed

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed: pip install 'dmuon-integrations[deepspeed]'",
)


def import_deepspeed() -> None:
    """DeepSpeed, imported in the test's process before the ranks fork, so they inherit it.

    With it the module DeepSpeed's ZeRO optimizer check imports at the first
    ``deepspeed.initialize`` of a process: ``deepspeed.runtime.zero.muon`` calls
    ``torch.compile`` at import, which imports Inductor (9 s of CPU in each rank, measured
    with cProfile, against a 25 s test on a busy machine).
    """
    import deepspeed

    # a DeepSpeed without its own Muon: nothing more to import early
    with contextlib.suppress(ImportError):
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401


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
