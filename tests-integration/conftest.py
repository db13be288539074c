import os
import pathlib
import sys

from hypothesis import HealthCheck, settings

# benchmarks/common (the byte-level GPT, corpus and optimizer factories shared with
# benchmarks/train.py and the demo) is part of the repository, not of an installed
# distribution: import it from the repository root.
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
