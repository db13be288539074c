"""The optional dependencies of ``dmuon-integrations``, named when one is missing.

``dmuon.integrations`` itself needs only torch and the other dmuon packages; the
modules for a framework import that framework, which comes with an extra of the
distribution (``pip install "dmuon-integrations[lightning]"``). A module imported
without its extra raises :func:`missing_extra`'s error, which says which extra to
install, instead of a bare ``ModuleNotFoundError`` from inside the framework's import.
"""

from __future__ import annotations

__all__ = ["EXTRAS", "missing_extra"]

EXTRAS = {
    "deepspeed": ("deepspeed",),
    "hf": ("transformers", "accelerate"),
    "lightning": ("lightning",),
    "torchtitan": ("torchtitan", "triton"),
}
"""Extra of ``dmuon-integrations`` → the top-level modules it installs (its
``[project.optional-dependencies]``)."""


def missing_extra(err: ModuleNotFoundError, module: str, extra: str) -> ModuleNotFoundError:
    """The error to raise from ``module`` whose import of an optional dependency failed.

    ``err`` is returned unchanged when what is missing is not a module ``extra`` brings
    (one of the framework's own dependencies, or a bug): only a missing top-level package
    of ``EXTRAS[extra]`` is translated.

    Examples:
        >>> err = ModuleNotFoundError("No module named 'lightning'", name="lightning")
        >>> missing_extra(err, "dmuon.integrations.lightning", "lightning").args[0].split(": ")[1]
        'pip install "dmuon-integrations[lightning]"'
    """
    root = (err.name or "").split(".")[0]
    if root not in EXTRAS.get(extra, ()):
        return err
    return ModuleNotFoundError(
        f'{module} needs {root}, which is not installed: pip install "dmuon-integrations[{extra}]"',
        name=err.name,
    )
