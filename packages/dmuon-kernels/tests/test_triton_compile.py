"""The kernel compiles for Hopper (sm90) and Ampere (sm80) without a GPU, every autotune
config fits the shared memory of its GPU, and batch/row offsets are 64-bit.

Triton can compile for a target GPU on a machine without one (down to PTX and
cubin with the bundled ptxas). This runs in a subprocess because the test session
defines the kernels for the interpreter.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dmuon.kernels.triton import symmetric_matmul as sm
    from dmuon.kernels.triton._configs import AMPERE, HOPPER, shared_memory_limit

    assert not sm.INTERPRETING
    jit = sm._lower_tile_kernel.fn
    result = []
    for capability, configs in (((9, 0), HOPPER), ((8, 0), AMPERE)):
        for cfg in configs:
            # As a real sym_poly launch on contiguous fp16 (B, m, m) specialises it: unit
            # strides become constants, pointers and the other ints divisible by 16.
            constexprs = dict(HAS_BETA=True, HAS_DIAG=True, UPCAST=False, PRECISION="ieee",
                              BLOCK=cfg.block, BLOCK_K=cfg.block_k,
                              stride_ak=1, stride_bn=1, stride_cn=1)
            signature = {}
            for name in jit.arg_names:
                if name in ("A", "B", "C"):
                    signature[name] = "*fp16"
                elif name in constexprs:
                    signature[name] = "constexpr"
                elif name in ("alpha", "beta", "diag"):
                    signature[name] = "fp32"
                else:
                    signature[name] = "i32"
            attrs = {
                (i,): [["tt.divisibility", 16]]
                for i, name in enumerate(jit.arg_names)
                if signature[name] in ("*fp16", "i32")
            }
            kernel = triton.compile(
                ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
            )
            ttir, ttgir = kernel.asm["ttir"], kernel.asm["ttgir"]
            result.append({
                "capability": capability,
                "config": [cfg.block, cfg.block_k, cfg.num_warps, cfg.num_stages],
                "shared": kernel.metadata.shared,
                "estimate": cfg.shared_memory(2),
                "limit": shared_memory_limit(capability),
                "batch_mul_i64": sum(
                    "arith.muli %batch" in line and line.split(" loc(")[0].endswith(": i64")
                    for line in ttir.splitlines()
                ),
                "row_mul_i64": sum(
                    "arith.muli" in line and "xi64>" in line for line in ttir.splitlines()
                ),
                "async_copies": ttgir.count("ttg.async_copy_global_to_local"),
                "wgmma": ttgir.count("ttng.warp_group_dot "),
            })
    import torch
    from dmuon.kernels.triton import syrk
    try:
        syrk(torch.ones(3, 4))
    except ValueError as exc:
        cpu_error = str(exc)
    else:
        cpu_error = ""
    print(json.dumps({"configs": result, "cpu_error": cpu_error}))
    """
)


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compiled_kernels_refuse_cpu_tensors_with_a_hint(compiled):
    assert compiled["cpu_error"].startswith(
        "syrk: X is on cpu; the Triton kernels need a CUDA tensor (set TRITON_INTERPRET=1"
    )


def test_every_config_compiles_for_its_gpu_and_fits_its_shared_memory(compiled):
    assert len(compiled["configs"]) == 8
    for entry in compiled["configs"]:
        assert entry["shared"] <= entry["limit"], entry
        # the pruning estimate is an upper bound of what Triton allocates
        assert entry["shared"] <= entry["estimate"], entry


def test_loads_are_software_pipelined_and_hopper_uses_wgmma(compiled):
    for entry in compiled["configs"]:
        # cp.async prefetch of the A and B tiles num_stages − 1 iterations ahead
        assert entry["async_copies"] >= 2, entry
        assert (entry["wgmma"] > 0) == (entry["capability"] == [9, 0]), entry


def test_batch_and_row_offsets_are_64_bit(compiled):
    for entry in compiled["configs"]:
        # batch · stride for A, B and C, each an i64 multiply
        assert entry["batch_mul_i64"] >= 3, entry
        # row/column index · stride on i64 tensors
        assert entry["row_mul_i64"] >= 3, entry
