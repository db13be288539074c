"""Helpers for the Triton tests: where they run and the rounding bound they are held to."""

import os

import torch

COMPILED = os.environ.get("DMUON_TRITON_COMPILED", "0") == "1"
"""True in the GPU check: compiled kernels on CUDA tensors instead of the interpreter."""
DEVICE = "cuda" if COMPILED else "cpu"

UNIT_ROUNDOFF = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64): 2^(e − p) for |x| in [2^e, 2^(e+1))."""
    info = torch.finfo(dtype)
    mag = x.abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def assert_within_one_ulp_of_fp32_accumulation(
    out: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int
) -> None:
    """``|out − exact| ≤ 1 ulp(out dtype) + γ_k · magnitude`` elementwise.

    The kernels accumulate ``k`` products in fp32 (error ≤ γ_k Σ|a||b| with
    γ_k = k·u₃₂/(1 − k·u₃₂), Higham, *Accuracy and Stability*, §3.1) and round once
    to the output dtype (≤ ½ ulp when rounding to nearest; the interpreter's bf16
    conversion may truncate, which is < 1 ulp). ``exact`` is float64 from the same
    rounded inputs; ``magnitude`` is the float64 Σ|a||b| (+ |β·A| + |δ|) bound.
    """
    u32 = 2.0**-24
    gamma = k * u32 / (1 - k * u32) + 2 * u32  # + the α, β, δ scaling in fp32
    bound = ulp(exact, out.dtype) + gamma * magnitude
    err = (out.to(torch.float64) - exact).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error reaches {worst:.3g}× the one-ulp bound"
