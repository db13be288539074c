"""The transforms update rules are chained from (DESIGN.md, "update rule as a chain").

Each transform maps a stacked batch of same-shape matrices ``(B, m, n)`` to the
next tensor of the chain, owns the state buffers it declares and never knows
which rank it runs on.
"""

from dmuon.optim.transforms.acceleration import GradDiffAcceleration
from dmuon.optim.transforms.base import (
    COMPUTE_DTYPES,
    StateSpec,
    StepContext,
    Transform,
    resolve_compute_dtype,
    run_chain,
)
from dmuon.optim.transforms.blocks import BlockPeriodicOrthogonalize, block_bounds
from dmuon.optim.transforms.clipping import MomentumSpectralClip
from dmuon.optim.transforms.momentum import Momentum
from dmuon.optim.transforms.normalization import (
    AdamPrecondition,
    ElementwiseNormalize,
    RowNormalize,
    SpectralNormalize,
    match_frobenius,
)
from dmuon.optim.transforms.orthogonalization import Orthogonalize
from dmuon.optim.transforms.scale import AdjustLR, SpectralRadius
from dmuon.optim.transforms.selection import ErrorFeedbackSelect, selected_count
from dmuon.optim.transforms.sign import MajorityVote, Sign
from dmuon.optim.transforms.subspace import (
    RANK_SCHEDULES,
    TopKPolar,
    rank_fraction_at,
    sketch_matrix,
    sketch_seed,
)

__all__ = [
    "COMPUTE_DTYPES",
    "RANK_SCHEDULES",
    "AdamPrecondition",
    "AdjustLR",
    "BlockPeriodicOrthogonalize",
    "ElementwiseNormalize",
    "ErrorFeedbackSelect",
    "GradDiffAcceleration",
    "MajorityVote",
    "Momentum",
    "MomentumSpectralClip",
    "Orthogonalize",
    "RowNormalize",
    "Sign",
    "SpectralNormalize",
    "SpectralRadius",
    "StateSpec",
    "StepContext",
    "TopKPolar",
    "Transform",
    "block_bounds",
    "match_frobenius",
    "rank_fraction_at",
    "resolve_compute_dtype",
    "run_chain",
    "selected_count",
    "sketch_matrix",
    "sketch_seed",
]
