"""dmuon.kernels works without Triton: a fresh interpreter in which `import triton` fails."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, warnings

    class BlockTriton:
        # A meta-path finder that makes Triton look uninstalled.
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, BlockTriton())
    warnings.simplefilter("error")

    import torch
    import dmuon.kernels as k

    assert not k.triton_available()
    G = torch.randn(3, 80, 200)
    for method in ("gram", "standard"):
        auto = k.orthogonalize(G, method=method)
        assert torch.equal(auto, k.orthogonalize(G, method=method, backend="torch"))
    try:
        k.orthogonalize(G, backend="triton")
    except ValueError as exc:
        print("triton backend:", exc)
    else:
        raise AssertionError("backend='triton' must fail without Triton")
    try:
        import dmuon.kernels.triton
    except ImportError as exc:
        print("import:", exc)
    else:
        raise AssertionError("dmuon.kernels.triton must not import without Triton")
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
    print("OK")
    """
)


def test_import_and_auto_backend_work_without_triton():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")
    assert "pip install 'dmuon-kernels[triton]'" in proc.stdout
    backend_line = next(
        line for line in proc.stdout.splitlines() if line.startswith("triton backend:")
    )
    assert backend_line.startswith("triton backend: backend='triton' needs Triton")
    assert backend_line.count("pip install") == 1, backend_line  # the hint said once
    assert "import: dmuon.kernels.triton needs Triton" in proc.stdout
    assert proc.stderr == ""  # no warnings, no log lines
