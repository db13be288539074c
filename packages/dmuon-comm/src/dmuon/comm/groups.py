"""Deprecated alias of :mod:`dmuon.comm.process_groups`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import warnings

from dmuon.comm.process_groups import *  # noqa: F403
from dmuon.comm.process_groups import __all__  # noqa: F401

warnings.warn(
    "dmuon.comm.groups was renamed dmuon.comm.process_groups; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)
