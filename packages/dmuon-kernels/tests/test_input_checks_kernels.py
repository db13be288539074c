"""Inputs the Newton–Schulz entry points refuse with a ValueError naming them.

A float8 matrix, a DTensor and an absurd step count used to fail deep inside (torch's
``NotImplementedError`` for float8's ``amax``, DTensor's "got mixed torch.Tensor and
DTensor" at the normalisation, a ``MemoryError`` building ``10**9`` triples).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dmuon.kernels import (
    gram_newton_schulz,
    newton_schulz,
    orthogonalize,
    spectral_clip,
    tp_gram_newton_schulz,
)
from dmuon.kernels.coefficients import MAX_STEPS, get_coefficients, resolve_coefficients

ENTRY_POINTS = [orthogonalize, newton_schulz, gram_newton_schulz]


@pytest.mark.parametrize("f", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_refused_naming_the_dtype_and_a_cast(f, dtype):
    G = torch.randn(4, 6).to(dtype)
    with pytest.raises(ValueError, match=rf"G must be a real floating-point.*{dtype}.*\.to\("):
        f(G)


def test_float8_is_refused_by_spectral_clip_and_tp_gram():
    G = torch.randn(4, 6).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="M must be a real floating-point"):
        spectral_clip(G, 1.0)
    with pytest.raises(ValueError, match="shard must be a real floating-point"):
        tp_gram_newton_schulz(G, split_dim=-1, reduce=lambda t, op: t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_four_float_dtypes_still_run(dtype):
    G = torch.randn(4, 6, dtype=torch.float64)
    O = orthogonalize(G.to(dtype), compute_dtype=torch.float64)
    assert O.dtype == dtype and O.shape == (4, 6)


_DTENSOR_SCRIPT = textwrap.dedent(
    """
    import os, socket, torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from dmuon.kernels import gram_newton_schulz, newton_schulz, orthogonalize, spectral_clip
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for placement in (Shard(0), Replicate()):
        G = distribute_tensor(torch.randn(4, 6), mesh, [placement])
        clip = lambda g: spectral_clip(g, 1.0)
        for f in (orthogonalize, newton_schulz, gram_newton_schulz, clip):
            try:
                f(G)
                print("accepted")
            except ValueError as e:
                print("ValueError:", e)
            except Exception as e:
                print("other:", type(e).__name__, e)
    dist.destroy_process_group()
    """
)


def test_a_dtensor_is_refused_pointing_to_full_tensor_and_to_local():
    """Run in a child process: a process group of one rank (gloo) for the DTensor."""
    done = subprocess.run(
        [sys.executable, "-c", _DTENSOR_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 8, done.stdout
    for line in lines:
        assert line.startswith("ValueError:"), line
        assert "is a DTensor" in line and ".full_tensor()" in line and ".to_local()" in line
        assert "tp_gram_newton_schulz" in line


@pytest.mark.parametrize("steps", [MAX_STEPS + 1, 10**9])
def test_steps_past_the_bound_are_refused_before_any_schedule_is_built(steps):
    G = torch.randn(4, 6)
    with pytest.raises(ValueError, match=rf"steps must be at most {MAX_STEPS}.*got {steps}"):
        orthogonalize(G, steps=steps)
    with pytest.raises(ValueError, match=rf"steps must be at most {MAX_STEPS}"):
        get_coefficients("polar_express", steps)
    with pytest.raises(ValueError, match=rf"steps must be at most {MAX_STEPS}"):
        resolve_coefficients([(1.5, -0.5, 0.0)], steps)


def test_steps_up_to_the_bound_and_long_explicit_lists_still_run():
    assert MAX_STEPS == 100  # DMuon's ns_steps bound (dmuon.optim.hyperparameters)
    assert len(get_coefficients("keller", MAX_STEPS)) == MAX_STEPS
    G = torch.randn(4, 6, dtype=torch.float64)
    O = orthogonalize(G, steps=MAX_STEPS, coefficients=[(1.5, -0.5, 0.0)])
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    torch.testing.assert_close(O, U @ Vh, rtol=0, atol=1e-6)
    # an explicit list longer than the bound is its own bound (the list is already there)
    triples = [(1.5, -0.5, 0.0)] * (MAX_STEPS + 20)
    assert len(resolve_coefficients(triples, MAX_STEPS + 20)) == MAX_STEPS + 20
