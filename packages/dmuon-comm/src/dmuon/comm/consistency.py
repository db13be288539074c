"""Deprecated alias of :mod:`dmuon.comm.plan_agreement`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import warnings

from dmuon.comm.plan_agreement import *  # noqa: F403
from dmuon.comm.plan_agreement import __all__  # noqa: F401

warnings.warn(
    "dmuon.comm.consistency was renamed dmuon.comm.plan_agreement; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)
