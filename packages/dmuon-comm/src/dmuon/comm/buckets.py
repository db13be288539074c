"""Deprecated alias of :mod:`dmuon.comm.flat_buffers`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import warnings

from dmuon.comm.flat_buffers import *  # noqa: F403
from dmuon.comm.flat_buffers import __all__  # noqa: F401

warnings.warn(
    "dmuon.comm.buckets was renamed dmuon.comm.flat_buffers; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)
