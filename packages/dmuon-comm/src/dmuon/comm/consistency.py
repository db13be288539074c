"""Deprecated alias of :mod:`dmuon.comm.plan_agreement`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import importlib
import warnings

from dmuon.comm.plan_agreement import *  # noqa: F403
from dmuon.comm.plan_agreement import __all__  # noqa: F401

warnings.warn(
    "dmuon.comm.consistency was renamed dmuon.comm.plan_agreement; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> object:
    """The old module's other names (not in ``__all__``, e.g. type aliases and constants),
    from :mod:`dmuon.comm.plan_agreement` where they live now."""
    try:
        return getattr(importlib.import_module("dmuon.comm.plan_agreement"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
