"""dmuon.kernels — Newton–Schulz orthogonalisation for the Muon optimizer family.

Pure tensor math with no distributed code: the standard and Gram Newton–Schulz
iterations, named coefficient schedules, the exact SVD polar factor used as the
test reference, FLOP counts and spectral clipping.
"""

from dmuon.kernels._version import __version__
from dmuon.kernels.coefficients import (
    COEFFICIENT_SETS,
    CoefficientSet,
    get_coefficients,
    ns_scalar_map,
)
from dmuon.kernels.compute_dtype import default_compute_dtype
from dmuon.kernels.flops import ns_flops
from dmuon.kernels.gram_newton_schulz import gram_newton_schulz
from dmuon.kernels.newton_schulz import newton_schulz
from dmuon.kernels.orthogonalize import METHODS, orthogonalize
from dmuon.kernels.polar import polar_factor
from dmuon.kernels.spectral_clip import spectral_clip

__all__ = [
    "COEFFICIENT_SETS",
    "METHODS",
    "CoefficientSet",
    "__version__",
    "default_compute_dtype",
    "get_coefficients",
    "gram_newton_schulz",
    "newton_schulz",
    "ns_flops",
    "ns_scalar_map",
    "orthogonalize",
    "polar_factor",
    "spectral_clip",
]
