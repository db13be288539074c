"""The optional dependencies of ``dmuon-integrations``, named when one is missing.

``dmuon.integrations`` itself needs only torch and the other dmuon packages; the
modules for a framework import that framework, which comes with an extra of the
distribution (``pip install "dmuon-integrations[lightning]"``; ``dmuon-optim`` has each of
them too, under the same name, and installs this one with it). A module imported
without its extra raises :func:`raise_missing_extra`'s error, which says which extra to
install, instead of a bare ``ModuleNotFoundError`` from inside the framework's import.
"""

from __future__ import annotations

__all__ = ["EXTRAS", "raise_missing_extra"]

EXTRAS = {
    "deepspeed": ("deepspeed",),
    "hf": ("transformers", "accelerate"),
    "lightning": ("lightning",),
    "torchtitan": ("torchtitan", "triton"),
}
"""Extra of ``dmuon-integrations`` → the top-level modules it installs (its
``[project.optional-dependencies]``)."""


def raise_missing_extra(err: ModuleNotFoundError, module: str, extra: str) -> None:
    """Raise the error that names ``extra`` when ``err`` says a module it brings is missing.

    Call it in ``module``'s ``except ModuleNotFoundError as err:`` around the framework's
    imports, then ``raise``: it returns (and the caller re-raises ``err`` as it is) when
    what is missing is not a module ``extra`` brings (one of the framework's own
    dependencies, or a bug); only a missing top-level package of ``EXTRAS[extra]`` is
    translated.

    Raises:
        ModuleNotFoundError: the extra's module is missing; the message says which
            ``pip install`` brings it, ``name`` is the missing module's.

    Examples:
        >>> err = ModuleNotFoundError("No module named 'lightning'", name="lightning")
        >>> raise_missing_extra(err, "my_module", "lightning")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ModuleNotFoundError: my_module needs lightning, ...: pip install "dmuon-integrations[...]"
        >>> other = ModuleNotFoundError("No module named 'yaml'", name="yaml")
        >>> raise_missing_extra(other, "dmuon.integrations.lightning", "lightning")  # returns
    """
    root = (err.name or "").split(".")[0]
    if root in EXTRAS.get(extra, ()):
        raise ModuleNotFoundError(
            f"{module} needs {root}, which is not installed: "
            f'pip install "dmuon-integrations[{extra}]"',
            name=err.name,
        ) from err
