"""Tile configurations of the symmetric kernels, per GPU generation, as plain data.

Tiles are square (``BLOCK × BLOCK``): a lower-triangle tile is mirrored onto its
upper partner, which only lines up when both sides are equal. The lists are
small on purpose: Triton compiles and times every surviving config the first
time a shape is seen.

* Hopper (sm90, 227 KiB shared memory per block) and Blackwell datacentre parts
  (sm100) take the larger ``128 × 128 × 64`` tiles with 3–4 pipeline stages.
* Ampere A100 (sm80, 163 KiB) and the consumer parts (sm86/89/120, ~99 KiB) take
  ``128 × 128 × 32`` and ``64 × 64`` tiles with fewer stages.
* The Triton interpreter (CPU, ``TRITON_INTERPRET=1``) gets one config with large
  blocks relative to the test shapes: every program instance is interpreted
  in Python, so fewer, larger tiles are what keeps it fast.

``DMUON_TRITON_AUTOTUNE=0`` skips the timing and takes the first config of the
GPU's list (what the GPU check's test phase uses to bound compile time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "AMPERE",
    "HOPPER",
    "INTERPRETER",
    "TileConfig",
    "arch_of",
    "select_configs",
    "shared_memory_limit",
]


@dataclass(frozen=True)
class TileConfig:
    """One autotune candidate: tile side, depth of the k-loop step, warps, pipeline stages.

    Examples:
        >>> from dmuon.kernels.triton import TileConfig
        >>> TileConfig(block=128, block_k=64, num_warps=8, num_stages=3).shared_memory(2)
        98304
    """

    block: int
    block_k: int
    num_warps: int
    num_stages: int

    def shared_memory(self, element_size: int) -> int:
        """Bytes of the A and B tiles staged in shared memory (Triton's software pipeline)."""
        return self.num_stages * 2 * self.block * self.block_k * element_size

    def accumulator_registers(self) -> int:
        """fp32 accumulator registers per thread: ``BLOCK² / (32 · num_warps)``."""
        return self.block * self.block // (32 * self.num_warps)


HOPPER: tuple[TileConfig, ...] = (
    TileConfig(128, 64, 8, 3),
    TileConfig(128, 64, 8, 4),
    TileConfig(128, 32, 8, 4),
    TileConfig(64, 64, 4, 4),
)
AMPERE: tuple[TileConfig, ...] = (
    TileConfig(128, 32, 8, 3),
    TileConfig(128, 32, 4, 4),
    TileConfig(64, 64, 4, 3),
    TileConfig(64, 32, 4, 4),
)
INTERPRETER: tuple[TileConfig, ...] = (TileConfig(64, 64, 4, 1),)

_KIB = 1024
# With 4-byte operands a 128-register accumulator per thread leaves too few of the 255 for
# the operand fragments: ptxas spilled 340–572 bytes for AMPERE's 128×32, 4-warp config in
# fp32 (benchmarks/results/triton-compile.json), so fp32 takes at most 64.
_FP32_MAX_ACCUMULATOR_REGISTERS = 64


def arch_of(capability: tuple[int, int]) -> str:
    """``"hopper"`` for sm90/sm100, ``"ampere"`` for everything else (sm80, sm86, sm89, sm120)."""
    return "hopper" if capability[0] in (9, 10) else "ampere"


def shared_memory_limit(capability: tuple[int, int]) -> int:
    """Opt-in shared memory per block in bytes.

    CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"
    (maximum shared memory per thread block); NVIDIA Ampere Tuning Guide §1.4.1.4 (A100:
    163 KB per block of the 164 KB per SM) and Hopper Tuning Guide §1.4.1.5 (H100: 227 KB
    of 228 KB per SM). One block of the symmetric kernel never needs more than this.
    """
    if capability[0] in (9, 10):
        return 227 * _KIB
    if capability == (8, 0) or capability == (8, 7):
        return 163 * _KIB
    if capability[0] >= 8:
        return 99 * _KIB
    return 48 * _KIB


def _tuning_enabled() -> bool:
    return os.environ.get("DMUON_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no")


def select_configs(
    capability: tuple[int, int], m: int, element_size: int, tune: bool | None = None
) -> list[TileConfig]:
    """The configs worth timing for an ``m × m`` output on a GPU of this capability.

    Drops configs whose staged tiles do not fit in shared memory, tiles more than
    twice the (power-of-two padded) output size and, for 4-byte operands, configs
    whose accumulator takes more than 64 registers per thread (they spill); always
    returns at least one config.
    """
    configs = HOPPER if arch_of(capability) == "hopper" else AMPERE
    limit = shared_memory_limit(capability)
    padded = 1 << max(0, (m - 1).bit_length())
    keep = [
        c
        for c in configs
        if c.shared_memory(element_size) <= limit
        and c.block <= max(64, padded)
        and (element_size < 4 or c.accumulator_registers() <= _FP32_MAX_ACCUMULATOR_REGISTERS)
    ]
    if not keep:
        keep = [min(configs, key=lambda c: c.shared_memory(element_size))]
    if tune is None:
        tune = _tuning_enabled()
    return keep if tune else keep[:1]
