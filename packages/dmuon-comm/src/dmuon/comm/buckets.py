"""Deprecated alias of :mod:`dmuon.comm.flat_buffers`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import importlib
import warnings

from dmuon.comm.flat_buffers import *  # noqa: F403
from dmuon.comm.flat_buffers import __all__  # noqa: F401

warnings.warn(
    "dmuon.comm.buckets was renamed dmuon.comm.flat_buffers; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> object:
    """The old module's other names (not in ``__all__``, e.g. type aliases and constants),
    from :mod:`dmuon.comm.flat_buffers` where they live now."""
    try:
        return getattr(importlib.import_module("dmuon.comm.flat_buffers"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
