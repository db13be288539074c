import importlib.metadata
import pathlib
import subprocess
import sys

import torch

import dmuon.kernels
from dmuon.kernels import cpu_has_native_bf16, default_compute_dtype, orthogonalize
from dmuon.kernels.compute_dtype import _native_bf16_in_cpuinfo

CPU_DEFAULT = torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def test_defaults_per_device_and_method():
    assert default_compute_dtype("cpu", "gram") == CPU_DEFAULT
    assert default_compute_dtype("cpu", "standard") == CPU_DEFAULT
    assert default_compute_dtype("cuda", "gram") == torch.float16
    assert default_compute_dtype("cuda", "standard") == torch.bfloat16
    assert default_compute_dtype("meta", "gram") == torch.float32


def test_default_on_cpu_is_the_result_in_the_cpu_default_dtype():
    G = torch.randn(16, 64)
    torch.testing.assert_close(
        orthogonalize(G), orthogonalize(G, compute_dtype=CPU_DEFAULT), rtol=0, atol=0
    )


def test_native_bf16_is_read_from_the_cpu_flags():
    """The flag parser: x86 ``flags`` and Arm ``Features`` lines, either answer."""
    cases = {
        "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n": True,
        "flags\t\t: fpu sse2 avx2 amx_tile amx_bf16\n": True,
        "flags\t\t: fpu sse2 avx2 avx512f\n": False,
        "Features\t: fp asimd bf16 i8mm\n": True,
        "Features\t: fp asimd\n": False,
        "": False,
    }
    for text, expected in cases.items():
        assert _native_bf16_in_cpuinfo("processor\t: 0\n" + text) is expected, text


def test_version_matches_distribution_metadata():
    assert dmuon.kernels.__version__ == importlib.metadata.version("dmuon-kernels")


def test_imports_nothing_from_other_dmuon_packages_or_torch_distributed():
    # Layering (DESIGN.md): kernels is pure tensor math. Checked on the source so
    # it holds whichever sibling packages happen to be installed.
    root = pathlib.Path(dmuon.kernels.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for forbidden in ("dmuon.comm", "dmuon.optim", "dmuon.integrations", "torch.distributed"):
            assert forbidden not in text, f"{path.name} refers to {forbidden}"
    code = (
        "import sys, dmuon.kernels; print(sorted(m for m in sys.modules if m.startswith('dmuon.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert all(name.startswith("dmuon.kernels") for name in eval(out.stdout))
