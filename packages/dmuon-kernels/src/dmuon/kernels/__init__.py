"""dmuon.kernels — Newton–Schulz orthogonalisation for the Muon optimizer family.

Pure tensor math with no distributed code: the standard and Gram Newton–Schulz
iterations, named coefficient schedules, the exact SVD polar factor used as the
test reference, FLOP counts and spectral clipping; the symmetric products as a
swappable set (torch, or the optional Triton kernels of :mod:`dmuon.kernels.triton`),
the per-shape autotuner that chooses between them, and CUDA-graph replay.
"""

from dmuon.kernels._version import __version__
from dmuon.kernels.autotune import (
    CROSS_CHECK_TOLERANCE,
    Autotuner,
    Decision,
    TuneKey,
    autotune_cache_dir,
    clear_autotune_cache,
    cross_check_error,
    cuda_event_timer,
    default_autotuner,
)
from dmuon.kernels.backends import (
    BACKENDS,
    MIN_TRITON_SIZE,
    resolve_backend,
    triton_available,
)
from dmuon.kernels.coefficients import (
    COEFFICIENT_SETS,
    CoefficientSet,
    get_coefficients,
    ns_scalar_map,
)
from dmuon.kernels.compute_dtype import cpu_has_native_bf16, default_compute_dtype
from dmuon.kernels.cuda_graphs import (
    NSGraphCache,
    cuda_graphs_enabled,
    release_cuda_graphs,
    set_cuda_graphs_enabled,
)
from dmuon.kernels.flops import ns_flops
from dmuon.kernels.gram_newton_schulz import gram_newton_schulz
from dmuon.kernels.newton_schulz import newton_schulz
from dmuon.kernels.orthogonalize import METHODS, orthogonalize
from dmuon.kernels.polar import polar_factor
from dmuon.kernels.spectral_clip import spectral_clip
from dmuon.kernels.symmetric_ops import (
    TORCH_OPS,
    SymmetricOps,
    sym_mul_torch,
    sym_poly_torch,
    syrk_torch,
)
from dmuon.kernels.tp_gram_newton_schulz import REDUCE_OPS, tp_gram_newton_schulz

__all__ = [
    "BACKENDS",
    "COEFFICIENT_SETS",
    "CROSS_CHECK_TOLERANCE",
    "METHODS",
    "MIN_TRITON_SIZE",
    "REDUCE_OPS",
    "TORCH_OPS",
    "Autotuner",
    "CoefficientSet",
    "Decision",
    "NSGraphCache",
    "SymmetricOps",
    "TuneKey",
    "__version__",
    "autotune_cache_dir",
    "clear_autotune_cache",
    "cpu_has_native_bf16",
    "cross_check_error",
    "cuda_event_timer",
    "cuda_graphs_enabled",
    "default_autotuner",
    "default_compute_dtype",
    "get_coefficients",
    "gram_newton_schulz",
    "newton_schulz",
    "ns_flops",
    "ns_scalar_map",
    "orthogonalize",
    "polar_factor",
    "release_cuda_graphs",
    "resolve_backend",
    "set_cuda_graphs_enabled",
    "spectral_clip",
    "sym_mul_torch",
    "sym_poly_torch",
    "syrk_torch",
    "tp_gram_newton_schulz",
    "triton_available",
]
