"""Reusable pieces of the training benchmarks, the demo and the integration tests:
the byte-level GPT, its corpus and deterministic batches, optimizer factories with
shared conventions, the training loop, metrics and plots."""

from benchmarks.common.data import (
    BatchSampler,
    Corpus,
    default_corpus_path,
    load_corpus,
    shard_rows,
    validation_batches,
)
from benchmarks.common.loop import Curve, evaluate, train
from benchmarks.common.metrics import machine_info, steps_to_reach
from benchmarks.common.model import GPT, Block, GPTConfig, hidden_matrix_names
from benchmarks.common.optimizers import (
    DEFAULT_OPTIMIZERS,
    DMuonUnavailableError,
    Optimizers,
    build_optimizer,
    is_hidden_matrix,
    lr_multiplier,
    parse_optimizer_name,
    require_dmuon,
)
from benchmarks.common.plots import plot_sweep, plot_validation
from benchmarks.common.progress import progress

__all__ = [
    "DEFAULT_OPTIMIZERS",
    "GPT",
    "BatchSampler",
    "Block",
    "Corpus",
    "Curve",
    "DMuonUnavailableError",
    "GPTConfig",
    "Optimizers",
    "build_optimizer",
    "default_corpus_path",
    "evaluate",
    "hidden_matrix_names",
    "is_hidden_matrix",
    "load_corpus",
    "lr_multiplier",
    "machine_info",
    "parse_optimizer_name",
    "plot_sweep",
    "plot_validation",
    "progress",
    "require_dmuon",
    "shard_rows",
    "steps_to_reach",
    "train",
    "validation_batches",
]
