"""dmuon.integrations: a skeleton; the package README says what is coming."""

from dmuon.integrations._version import __version__

__all__ = ["__version__"]
