import importlib.metadata
import pathlib
import subprocess
import sys

import torch

import dmuon.kernels
from dmuon.kernels import default_compute_dtype, orthogonalize


def test_defaults_per_device_and_method():
    assert default_compute_dtype("cpu", "gram") == torch.bfloat16
    assert default_compute_dtype("cpu", "standard") == torch.bfloat16
    assert default_compute_dtype("cuda", "gram") == torch.float16
    assert default_compute_dtype("cuda", "standard") == torch.bfloat16
    assert default_compute_dtype("meta", "gram") == torch.float32


def test_default_on_cpu_is_the_bf16_result():
    G = torch.randn(16, 64)
    torch.testing.assert_close(
        orthogonalize(G), orthogonalize(G, compute_dtype=torch.bfloat16), rtol=0, atol=0
    )


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
