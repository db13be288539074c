"""Deprecated alias of :mod:`dmuon.comm.process_groups`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import importlib
import warnings

from dmuon.comm.process_groups import *  # noqa: F403
from dmuon.comm.process_groups import __all__  # noqa: F401

warnings.warn(
    "dmuon.comm.groups was renamed dmuon.comm.process_groups; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> object:
    """The old module's other names (not in ``__all__``, e.g. type aliases and constants),
    from :mod:`dmuon.comm.process_groups` where they live now."""
    try:
        return getattr(importlib.import_module("dmuon.comm.process_groups"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
