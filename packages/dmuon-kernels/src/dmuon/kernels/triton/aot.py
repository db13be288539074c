"""Compile the symmetric kernel for a real GPU on a machine without one.

Triton lowers a kernel ahead of time for any target it knows: ``triton.compile`` of
an :class:`triton.compiler.ASTSource` with ``GPUTarget("cuda", 90, 32)`` runs the
whole pipeline (TTIR, TTGIR, LLVM IR, PTX) and the bundled ``ptxas`` down to a
cubin, with no GPU and no CUDA driver. This catches on a CPU what the interpreter
cannot: an op the target does not lower, a layout error, a tile whose staged
operands do not fit in shared memory, and register pressure (spills).

:func:`compile_candidates` compiles every config the autotuner may pick on a target
(:func:`~dmuon.kernels.triton._configs.select_configs` for the largest ``m``: the
size pruning only removes configs), for each operand dtype and for the two ways
the kernel is launched:

* ``"syrk"``: ``C = A·Aᵀ`` with ``B`` the transposed view of ``A`` (unit stride
  along ``k``), no ``β·A`` or ``δ·I`` term;
* ``"sym_poly"``: ``C = c·A² + b·A + a·I`` with ``B = A`` (unit stride along the
  columns), both epilogue terms on; ``sym_mul`` is this code without ``δ·I``.

Each record holds the registers per thread, spill stores/loads (``ptxas -v``),
stack frame and shared memory (Triton's allocation; the 1 KiB ``SHARED`` of
``cuobjdump`` is static scratch and is included in Triton's figure). Sources: the
Triton compiler (``triton/compiler/compiler.py``, ``backends/nvidia/compiler.py``,
3.7.1); shared-memory limits in :func:`~dmuon.kernels.triton._configs.shared_memory_limit`.

Run it in a process that did not set ``TRITON_INTERPRET=1`` before importing
:mod:`dmuon.kernels.triton` (the kernel is then defined for the interpreter and
cannot be lowered).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dmuon.kernels.triton._configs import TileConfig, select_configs, shared_memory_limit

__all__ = [
    "TARGETS",
    "VARIANTS",
    "CompiledConfig",
    "autotune_candidates",
    "compile_candidates",
    "compile_config",
]

TARGETS: tuple[tuple[int, int], ...] = ((8, 0), (9, 0))
"""A100 (sm80) and H100/H200 (sm90)."""

VARIANTS = ("syrk", "sym_poly")

_TRITON_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# The largest m the size pruning of select_configs can see: it then removes nothing.
_ANY_M = 1 << 20


@dataclass(frozen=True)
class CompiledConfig:
    """What ``ptxas`` and Triton report for one (target, dtype, variant, config)."""

    capability: tuple[int, int]
    dtype: str
    precision: str
    variant: str
    config: tuple[int, int, int, int]  # block, block_k, num_warps, num_stages
    shared: int  # bytes of dynamic shared memory Triton allocates for one block
    shared_estimate: int  # TileConfig.shared_memory: what the autotuner's pruning assumes
    shared_limit: int  # opt-in maximum per block of the target
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of the per-thread stack frame
    wgmma: bool  # Hopper warp-group MMA in the TTGIR
    async_copies: int  # cp.async prefetches of the operand tiles in the TTGIR
    batch_mul_i64: int  # batch index · stride multiplies done in int64 (TTIR)
    row_mul_i64: int  # row/column index · stride multiplies on int64 tensors (TTIR)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def autotune_candidates(capability: tuple[int, int], dtype: torch.dtype) -> list[TileConfig]:
    """Every config the autotuner of :mod:`.symmetric_matmul` may time on this GPU and dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    return select_configs(capability, _ANY_M, size, tune=True)


def _signature(jit: Any, dtype: torch.dtype, variant: str, precision: str, cfg: TileConfig):
    """Signature, constants and attributes as a real launch on contiguous tensors specialises
    them: integer arguments equal to 1 become constants, pointers and the other integers
    are divisible by 16 (true of every size the optimizer sees with ``m, k ≥ 16``)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    ptr = "*" + _TRITON_TYPE[dtype]
    constexprs: dict[str, Any] = dict(
        HAS_BETA=variant == "sym_poly",
        HAS_DIAG=variant == "sym_poly",
        UPCAST=False,
        PRECISION=precision,
        BLOCK=cfg.block,
        BLOCK_K=cfg.block_k,
        stride_ak=1,
        stride_cn=1,
    )
    # syrk passes B = Aᵀ (unit stride along k); sym_poly/sym_mul a contiguous square B
    constexprs["stride_bk" if variant == "syrk" else "stride_bn"] = 1
    signature: dict[str, str] = {}
    for name in jit.arg_names:
        if name in ("A", "B", "C"):
            signature[name] = ptr
        elif name in constexprs:
            signature[name] = "constexpr"
        elif name in ("alpha", "beta", "diag"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(jit.arg_names)
        if signature[name] == ptr or signature[name] == "i32"
    }
    return signature, constexprs, attrs


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack)`` of the kernel in a cubin, from the bundled ``cuobjdump``."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        tool = triton.knobs.nvidia.cuobjdump.path
        text = subprocess.run(
            [tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return int(match.group(1)), int(match.group(2))


def compile_config(
    capability: tuple[int, int],
    cfg: TileConfig,
    dtype: torch.dtype,
    variant: str,
    precision: str = "ieee",
) -> CompiledConfig:
    """Compile the kernel for one target GPU, tile config, dtype and launch variant.

    Raises whatever Triton or ``ptxas`` raise when the kernel cannot be lowered for
    the target (``triton.compiler.errors.CompilationError``, ``PTXASError``,
    ``OutOfResources``), and a ValueError for a dtype the kernel does not take.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dmuon.kernels.triton import symmetric_matmul as sm

    if sm.INTERPRETING:
        raise RuntimeError(
            "compile_config: dmuon.kernels.triton was imported with TRITON_INTERPRET=1; "
            "the kernel is defined for the interpreter and cannot be lowered"
        )
    if dtype not in _TRITON_TYPE:
        raise ValueError(f"dtype must be one of {tuple(_TRITON_TYPE)}, got {dtype}")
    jit = sm._lower_tile_kernel.fn
    signature, constexprs, attrs = _signature(jit, dtype, variant, precision, cfg)
    log = io.StringIO()
    knobs = triton.knobs
    # Always run ptxas (a cached kernel has no log) and have it print its -v report.
    with (
        knobs.compilation.scope(),
        knobs.nvidia.scope(),
        contextlib.redirect_stdout(log),
    ):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(
            ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
        )
    ptxas = log.getvalue()
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    if spills is None:
        raise RuntimeError(f"ptxas -v printed no spill report:\n{ptxas[-2000:]}")
    registers, stack = _resource_usage(kernel.asm["cubin"])
    ttir, ttgir = kernel.asm["ttir"], kernel.asm["ttgir"]
    return CompiledConfig(
        capability=capability,
        dtype=_TRITON_TYPE[dtype],
        precision=precision,
        variant=variant,
        config=(cfg.block, cfg.block_k, cfg.num_warps, cfg.num_stages),
        shared=int(kernel.metadata.shared),
        shared_estimate=cfg.shared_memory(torch.empty((), dtype=dtype).element_size()),
        shared_limit=shared_memory_limit(capability),
        registers=registers,
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
        stack=stack,
        wgmma="ttng.warp_group_dot " in ttgir,
        async_copies=ttgir.count("ttg.async_copy_global_to_local"),
        batch_mul_i64=sum(
            "arith.muli %batch" in line and line.split(" loc(")[0].endswith(": i64")
            for line in ttir.splitlines()
        ),
        row_mul_i64=sum("arith.muli" in line and "xi64>" in line for line in ttir.splitlines()),
    )


def _jobs() -> list[tuple[tuple[int, int], TileConfig, torch.dtype, str, str]]:
    jobs = []
    for capability in TARGETS:
        for dtype in _TRITON_TYPE:
            # fp32 runs with IEEE products by default, TF32 when torch allows it
            precisions = ("ieee", "tf32") if dtype == torch.float32 else ("ieee",)
            for precision in precisions:
                for cfg in autotune_candidates(capability, dtype):
                    for variant in VARIANTS:
                        jobs.append((capability, cfg, dtype, variant, precision))
    return jobs


def _run(job) -> dict[str, Any]:
    capability, cfg, dtype, variant, precision = job
    try:
        return compile_config(capability, cfg, dtype, variant, precision).as_dict()
    except Exception as exc:  # reported per config, so one failure does not hide the rest
        return {
            "capability": capability,
            "dtype": _TRITON_TYPE[dtype],
            "precision": precision,
            "variant": variant,
            "config": (cfg.block, cfg.block_k, cfg.num_warps, cfg.num_stages),
            "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
        }


def compile_candidates(workers: int | None = None) -> list[dict[str, Any]]:
    """Compile every (target, dtype, precision, autotune config, variant); one record each.

    A config that fails to compile gives a record with an ``"error"`` entry instead of
    the figures. ``workers`` processes share the work (default: the CPUs of this
    process, at most 4); each is a fresh interpreter, so ``TRITON_INTERPRET`` is
    removed from their environment.
    """
    jobs = _jobs()
    if workers is None:
        workers = max(1, min(4, len(os.sched_getaffinity(0))))
    if workers == 1:
        return [_run(job) for job in jobs]
    import multiprocessing

    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            return pool.map(_run, jobs, chunksize=1)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
