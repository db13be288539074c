"""Deprecated alias of :mod:`dmuon.optim.batches`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import warnings

from dmuon.optim.batches import *  # noqa: F403
from dmuon.optim.batches import __all__  # noqa: F401

warnings.warn(
    "dmuon.optim.buckets was renamed dmuon.optim.batches; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)
