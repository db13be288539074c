"""dmuon.optim.planner — predict DMuon's cost at cluster scale from a model config.

``dmuon-plan`` (or ``python -m dmuon.optim.planner``) reads a model (a Hugging Face
``config.json``, a preset or ``module:factory``), a cluster (device profile, GPUs,
interconnects) and a training shape, and prints the owner plan, the Newton–Schulz
FLOPs and time per rank, the bytes per rank of each mode, the exposed communication,
the predicted step and memory per rank for AdamW, vanilla distributed Muon and DMuon
in each mode, and every assumption with its source. See the guide "Planning a run"
and the concepts page "The step-time model".
"""

from dmuon.optim.planner.config import PRESETS, ConfigError, ModelSpec, load_model
from dmuon.optim.planner.profiles import (
    DEVICES,
    INTERCONNECTS,
    ClusterProfile,
    DeviceProfile,
    Link,
    load_device_profile,
)
from dmuon.optim.planner.traffic import DMUON_MODES, Transfer, dmuon_transfers

__all__ = [
    "DEVICES",
    "DMUON_MODES",
    "INTERCONNECTS",
    "PRESETS",
    "ClusterProfile",
    "ConfigError",
    "DeviceProfile",
    "Link",
    "ModelSpec",
    "Transfer",
    "dmuon_transfers",
    "load_device_profile",
    "load_model",
]
