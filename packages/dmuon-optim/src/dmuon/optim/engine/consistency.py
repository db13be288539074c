"""Deprecated alias of :mod:`dmuon.optim.engine.model_agreement`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import warnings

from dmuon.optim.engine.model_agreement import *  # noqa: F403
from dmuon.optim.engine.model_agreement import __all__  # noqa: F401

warnings.warn(
    "dmuon.optim.engine.consistency was renamed "
    "dmuon.optim.engine.model_agreement; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)
