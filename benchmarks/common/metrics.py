"""What a convergence comparison reports: when a curve reaches a target loss, and
on which machine the figures were taken.

Example:
    >>> from benchmarks.common.metrics import steps_to_reach
    >>> steps_to_reach([0, 100, 200], [5.0, 3.0, 2.0], target=2.5)   # halfway 100→200
    150.0
    >>> steps_to_reach([0, 100], [5.0, 3.0], target=2.5) is None      # never reached
    True
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import os
import pathlib
import platform
import re
import subprocess
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["allocator_settings", "file_tag", "machine_info", "steps_to_reach"]


def steps_to_reach(xs: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """The first ``x`` (step or seconds) at which a piecewise-linear loss curve
    reaches ``target``, or ``None`` if it never does.

    Between two evaluations ``(x₀, l₀)``, ``(x₁, l₁)`` with ``l₀ > target ≥ l₁``::

        x = x₀ + (l₀ − target)/(l₀ − l₁) · (x₁ − x₀)

    Linear interpolation reads the crossing between evaluation points instead of
    rounding it up to the next evaluation.

    Raises:
        ValueError: ``xs`` and ``losses`` of different lengths.
    """
    if len(xs) != len(losses):
        raise ValueError(f"xs and losses differ in length: {len(xs)} and {len(losses)}")
    for i, (x, loss) in enumerate(zip(xs, losses, strict=True)):
        if loss <= target:
            if i == 0:
                return float(x)
            x0, l0 = xs[i - 1], losses[i - 1]
            return float(x0 + (l0 - target) / (l0 - loss) * (x - x0))
    return None


def _cpu_native_bf16() -> bool | None:
    """dmuon.kernels' answer (AVX-512-BF16, AMX or Arm BF16); None without dmuon-kernels."""
    try:
        from dmuon.kernels import cpu_has_native_bf16
    except ImportError:
        return None
    return cpu_has_native_bf16()


def file_tag(text: str) -> str:
    """The ``--tag`` of a benchmark as the suffix of its result files: ``"nobf16"`` and
    ``"-nobf16"`` both give ``"-nobf16"`` (argparse reads ``--tag -nobf16`` as a missing
    value, so the dash is optional; ``--tag=-nobf16`` works too), ``""`` gives ``""``.

    Raises:
        argparse.ArgumentTypeError: characters other than letters, digits, ``.``, ``_``
            and ``-`` (the tag becomes part of a file name).

    Examples:
        >>> file_tag("nobf16"), file_tag("-nobf16"), file_tag("")
        ('-nobf16', '-nobf16', '')
    """
    if text and not re.fullmatch(r"[A-Za-z0-9._-]+", text):
        raise argparse.ArgumentTypeError(
            f"--tag must be letters, digits, '.', '_' or '-' (it names the result files), "
            f"got {text!r}"
        )
    return "" if not text else text if text.startswith("-") else f"-{text}"


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=pathlib.Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


ALLOCATOR_VARIABLES = (
    "LD_PRELOAD",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_CONF",
)


def allocator_settings() -> dict[str, str]:
    """The environment that decides how host memory is allocated (empty: glibc's defaults).

    CPU timings depend on it: with glibc's dynamic mmap threshold, a process may serve
    every large temporary from fresh ``mmap``-ed pages and pay a page fault per 4 KiB on
    first touch (on a 2-core AMD EPYC, torch 2.13: 5,728 faults and 12.6 ms against 1.7 ms
    for the two normalising passes of a 768 × 3072 matrix), or not, by the history of its
    allocations. ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` or a preloaded
    jemalloc/tcmalloc remove the difference (docs: Troubleshooting, "CPU steps slower in
    some processes than in others").
    """
    return {k: os.environ[k] for k in ALLOCATOR_VARIABLES if os.environ.get(k)}


def _triton_version() -> str | None:
    """Triton's version from its distribution metadata (no import: importing triton on a
    machine without a GPU driver can be slow or noisy); ``None`` when it is absent."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine_info(
    device: str = "cpu",
    *,
    world_size: int | None = None,
    threads_per_rank: int | None = None,
) -> dict[str, Any]:
    """Date, versions and hardware for a result file.

    Args:
        device: what the timed code ran on.
        world_size: the number of processes of a distributed run (recorded when given).
        threads_per_rank: the torch threads each rank ran with, for a run whose ranks set
            their own (``run_on_ranks(threads_per_rank=...)``). When given it is what
            ``torch_threads`` records: the launching process's own count (torch's default,
            the cores) says nothing about the timed code, and a reader of
            ``torch_threads`` would take it for the ranks'. The launcher's count is kept
            as ``launcher_torch_threads``.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "cpu": _cpu_name(),
        "cores": cores,
        # CPU figures for bf16 depend on it: emulated bf16 matmul is ~40x slower than fp32.
        "cpu_native_bf16": _cpu_native_bf16(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # the GPU kernels' figures depend on it (autotuned tiles, generated code)
        "triton": _triton_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "allocator": allocator_settings(),
    }
    if world_size is not None:
        info["world_size"] = world_size
    if threads_per_rank is not None:
        info["launcher_torch_threads"] = info["torch_threads"]
        info["torch_threads"] = threads_per_rank
        info["threads_per_rank"] = threads_per_rank
    for package in ("kernels", "comm", "optim", "integrations"):
        try:
            info[f"dmuon_{package}"] = importlib.import_module(f"dmuon.{package}").__version__
        except (ImportError, AttributeError):
            info[f"dmuon_{package}"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info
