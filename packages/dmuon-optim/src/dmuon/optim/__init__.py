"""dmuon.optim — the DMuon optimizer and the Muon family of update rules.

``DMuon`` is a drop-in ``torch.optim.Optimizer``; ``param_groups(model)`` decides
which parameters take the matrix rule and which AdamW/Lion. The rules are chains
of small transforms (:mod:`dmuon.optim.transforms`) over stacked batches of
same-shape matrices, written so that the distributed engine runs them unchanged.
"""

from dmuon.optim._version import __version__
from dmuon.optim.apply import apply_update
from dmuon.optim.assignment import Assignment, ParamGroups, param_groups
from dmuon.optim.attention_logits import head_max_logits
from dmuon.optim.batches import (
    Bucket,
    Entry,
    build_buckets,
    default_batch_elements,
    state_shapes,
    step_bucket,
)
from dmuon.optim.clip import clip_grad_norm_, clip_grad_value_
from dmuon.optim.engine import (
    MODES,
    GradientChangedError,
    GradientPresenceError,
    GroupValuesError,
    ModelMismatchError,
    NonFiniteGradientError,
    OwnerExchange,
    RankDivergenceError,
    StaleGradientError,
    StepMismatchError,
    StepReport,
    ThawedParameterError,
    UnsyncedGradientsError,
)
from dmuon.optim.layout import Block, MatrixLayout, matrix_layout
from dmuon.optim.matrix_split import MatrixSplit, local_tensor
from dmuon.optim.optimizer import DMuon
from dmuon.optim.qk_clip import QKClip, QKClipReport
from dmuon.optim.qk_heads import AttentionHeads, HeadRows
from dmuon.optim.rules import RULES, Rule, get_rule
from dmuon.optim.scalar import (
    SCALAR_ALGORITHMS,
    SCALAR_RULES,
    ScalarRule,
    adamw_step,
    get_scalar_rule,
    lion_step,
)
from dmuon.optim.scaling import ADJUST_LR, adjust_lr_factor
from dmuon.optim.vote import SignVote, local_vote

__all__ = [
    "ADJUST_LR",
    "MODES",
    "RULES",
    "SCALAR_ALGORITHMS",
    "SCALAR_RULES",
    "Assignment",
    "AttentionHeads",
    "Block",
    "Bucket",
    "DMuon",
    "Entry",
    "GradientChangedError",
    "GradientPresenceError",
    "GroupValuesError",
    "HeadRows",
    "MatrixLayout",
    "MatrixSplit",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "OwnerExchange",
    "ParamGroups",
    "QKClip",
    "QKClipReport",
    "RankDivergenceError",
    "Rule",
    "ScalarRule",
    "SignVote",
    "StaleGradientError",
    "StepMismatchError",
    "StepReport",
    "ThawedParameterError",
    "UnsyncedGradientsError",
    "__version__",
    "adamw_step",
    "adjust_lr_factor",
    "apply_update",
    "build_buckets",
    "clip_grad_norm_",
    "clip_grad_value_",
    "default_batch_elements",
    "get_rule",
    "get_scalar_rule",
    "head_max_logits",
    "lion_step",
    "local_tensor",
    "local_vote",
    "matrix_layout",
    "param_groups",
    "state_shapes",
    "step_bucket",
]
