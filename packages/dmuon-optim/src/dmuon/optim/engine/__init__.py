"""The distributed step engine: how a step runs in each execution mode.

See the Concepts page "Execution modes" for the modes and their traffic.
"""

from dmuon.optim.engine.base import Engine, SingleEngine, Stepper
from dmuon.optim.engine.exchange import OwnerExchange, exchange_of, format_description
from dmuon.optim.engine.guards import (
    NONFINITE_POLICIES,
    GradientChangedError,
    GroupValuesError,
    NonFiniteGradientError,
    RankDivergenceError,
    StaleGradientError,
    StepMismatchError,
    ThawedParameterError,
    agree_step,
    check_agreement,
    guard_groups,
    nonfinite_ranks,
)
from dmuon.optim.engine.layer_record import DEFAULT_PACK_MB, OwnerLayer
from dmuon.optim.engine.model_agreement import ModelMismatchError, check_model_consistency
from dmuon.optim.engine.modes import MODES, make_engine
from dmuon.optim.engine.owner import OwnerEngine
from dmuon.optim.engine.params import EngineParam, collect_params, item_shape, subplan
from dmuon.optim.engine.placements import (
    MatrixPlacement,
    check_placements,
    placement_of,
    supported_by,
)
from dmuon.optim.engine.planned import Pipeline, PlannedEngine
from dmuon.optim.engine.publication import Publication
from dmuon.optim.engine.reduction import Reduction, UnsyncedGradientsError
from dmuon.optim.engine.replicated import ReplicatedEngine
from dmuon.optim.engine.report import PHASES, StepReport
from dmuon.optim.engine.sharded import ShardedEngine
from dmuon.optim.engine.sign import SignEngine
from dmuon.optim.engine.split_presence import GradientPresenceError

__all__ = [
    "DEFAULT_PACK_MB",
    "MODES",
    "NONFINITE_POLICIES",
    "PHASES",
    "Engine",
    "EngineParam",
    "GradientChangedError",
    "GradientPresenceError",
    "GroupValuesError",
    "MatrixPlacement",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "OwnerEngine",
    "OwnerExchange",
    "OwnerLayer",
    "Pipeline",
    "PlannedEngine",
    "Publication",
    "RankDivergenceError",
    "Reduction",
    "ReplicatedEngine",
    "ShardedEngine",
    "SignEngine",
    "SingleEngine",
    "StaleGradientError",
    "StepMismatchError",
    "StepReport",
    "Stepper",
    "ThawedParameterError",
    "UnsyncedGradientsError",
    "agree_step",
    "check_agreement",
    "check_model_consistency",
    "check_placements",
    "collect_params",
    "exchange_of",
    "format_description",
    "guard_groups",
    "item_shape",
    "make_engine",
    "nonfinite_ranks",
    "placement_of",
    "subplan",
    "supported_by",
]
