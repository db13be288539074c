import os

# The Triton kernels run in Triton's interpreter on the CPU. @triton.jit decides between
# compiling and interpreting when a kernel is *defined*, so this must happen before
# anything imports dmuon.kernels.triton. The GPU check (benchmarks/gpu_check.py) sets
# DMUON_TRITON_COMPILED=1 to run the same tests with compiled kernels on CUDA tensors.
if os.environ.get("DMUON_TRITON_COMPILED", "0") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from hypothesis import HealthCheck, settings

# Deterministic and bounded: CI runs on 2 cores with a time budget.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "aot_compile: Triton compiles for sm80/sm90 without a GPU (minutes on two cores); "
        "CI runs them in nox -s compat only",
    )
