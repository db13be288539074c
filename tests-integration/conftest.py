import os
import pathlib
import sys

# torch.optim.Optimizer imports torch._dynamo at its first add_param_group (its
# `_disable_dynamo` wrapper), several seconds of CPU. A rank forked by
# dmuon.comm.testing.run_on_ranks from a process that had not built an optimizer yet
# imported it again, every rank of every launch at once: test_timeouts.py and
# test_group_values_agreed.py took 51 s instead of 26 s on two busy cores. Imported
# here, once per pytest worker, every rank inherits it.
import torch._dynamo  # noqa: F401
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
