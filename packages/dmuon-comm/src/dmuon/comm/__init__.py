"""dmuon.comm: a skeleton; the package README says what is coming."""

from dmuon.comm._version import __version__

__all__ = ["__version__"]
