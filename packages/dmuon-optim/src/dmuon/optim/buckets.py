"""Deprecated alias of :mod:`dmuon.optim.batches`.

Renamed so that each module name means one thing in the repository; this alias
is removed in the next release.
"""

import importlib
import warnings

from dmuon.optim.batches import *  # noqa: F403
from dmuon.optim.batches import __all__  # noqa: F401

warnings.warn(
    "dmuon.optim.buckets was renamed dmuon.optim.batches; import from the new name",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> object:
    """The old module's other names (not in ``__all__``, e.g. type aliases and constants),
    from :mod:`dmuon.optim.batches` where they live now."""
    try:
        return getattr(importlib.import_module("dmuon.optim.batches"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
