"""The kernel compiles for Hopper (sm90) and Ampere (sm80) without a GPU: every config
the autotuner may pick, for fp16, bf16 and fp32 (IEEE and TF32 products), in both launch
variants (``syrk``, ``sym_poly``), fits the shared memory of its GPU, does not spill more
than a few words, and computes batch/row offsets in 64 bits.

Triton can compile for a target GPU on a machine without one (down to PTX and
cubin with the bundled ptxas, :mod:`dmuon.kernels.triton.aot`). This runs in a
subprocess because the test session defines the kernels for the interpreter. About
60 compiles: 2–3 minutes on two cores. ``benchmarks/triton_compile.py`` runs the same
compiles and writes the figures to ``benchmarks/results/triton-compile.json``.

Marked ``aot_compile``: CI runs these once, in ``nox -s compat`` (triton 3.6, the GPU
image's release); ``nox -s tests-kernels`` deselects them with ``-m "not aot_compile"``.
A plain ``pytest`` runs them.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.aot_compile

SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from dmuon.kernels.triton import syrk
    from dmuon.kernels.triton.aot import compile_candidates

    records = compile_candidates()
    try:
        syrk(torch.ones(3, 4))
    except ValueError as exc:
        cpu_error = str(exc)
    else:
        cpu_error = ""
    print(json.dumps({"configs": records, "cpu_error": cpu_error}))
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


def test_every_autotune_candidate_of_every_dtype_and_target_is_compiled(compiled):
    from dmuon.kernels.triton._configs import select_configs

    seen = {
        (tuple(e["capability"]), e["dtype"], e["precision"], e["variant"], tuple(e["config"]))
        for e in compiled["configs"]
    }
    expected = set()
    for capability in ((8, 0), (9, 0)):
        for dtype, size, precisions in (
            ("fp16", 2, ("ieee",)),
            ("bf16", 2, ("ieee",)),
            ("fp32", 4, ("ieee", "tf32")),
        ):
            # the union over m of what the autotuner may time: the size pruning only removes
            for m in (64, 128, 1 << 20):
                for cfg in select_configs(capability, m, size, tune=True):
                    for precision in precisions:
                        for variant in ("syrk", "sym_poly"):
                            config = (cfg.block, cfg.block_k, cfg.num_warps, cfg.num_stages)
                            expected.add((capability, dtype, precision, variant, config))
    assert seen == expected
    assert len(seen) >= 50


def test_every_config_compiles_for_its_gpu_and_fits_its_shared_memory(compiled):
    for entry in compiled["configs"]:
        assert "error" not in entry, entry
        assert entry["shared"] <= entry["shared_limit"], entry
        # the pruning estimate is an upper bound of what Triton allocates
        assert entry["shared"] <= entry["shared_estimate"], entry


def test_no_config_spills_more_than_a_few_words(compiled):
    # ptxas moves a few words of addressing state to local memory in some fp32 configs
    # (4–12 bytes measured); an accumulator that does not fit in registers spills hundreds
    # of bytes (340–572 for the pruned 128×32, 4-warp fp32 config on sm80).
    for entry in compiled["configs"]:
        assert entry["registers"] <= 255, entry
        assert entry["spill_stores"] <= 64 and entry["spill_loads"] <= 64, entry


def test_loads_are_software_pipelined_and_hopper_uses_wgmma(compiled):
    for entry in compiled["configs"]:
        if entry["dtype"] == "fp32" and entry["precision"] == "ieee":
            continue  # IEEE fp32 products run on the FMA units: no MMA, no wgmma
        # cp.async prefetch of the A and B tiles num_stages − 1 iterations ahead
        assert entry["async_copies"] >= 2, entry
        assert entry["wgmma"] == (entry["capability"] == [9, 0]), entry


def test_batch_and_row_offsets_are_64_bit(compiled):
    for entry in compiled["configs"]:
        # batch · stride for A, B and C, each an i64 multiply
        assert entry["batch_mul_i64"] >= 3, entry
        # row/column index · stride on i64 tensors
        assert entry["row_mul_i64"] >= 3, entry
