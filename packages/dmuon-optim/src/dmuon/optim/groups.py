"""Deprecated alias of :mod:`dmuon.optim.assignment`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import warnings

from dmuon.optim.assignment import *  # noqa: F403
from dmuon.optim.assignment import __all__  # noqa: F401

warnings.warn(
    "dmuon.optim.groups was renamed dmuon.optim.assignment; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)
