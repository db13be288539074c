"""What the planner plans: matrices described by name, shape, dtype and layer."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["MatrixItem", "layer_key", "matrix_items"]

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    )
}


def _as_dtype(dtype: Any, name: str) -> torch.dtype:
    """The item's dtype, one of :data:`_DTYPES` (as a ``torch.dtype`` or its name).

    Only those: the set the error lists is the set accepted, so a complex or bool dtype
    (no parameter DMuon steps has one) is refused here too, not later by a bucket or a
    collective that has no such dtype."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(
        f"item {name!r}: dtype must be a torch.dtype or one of {sorted(_DTYPES)} (those "
        f"dtypes only), got {dtype!r}"
    )


@dataclass(frozen=True)
class MatrixItem:
    """One matrix (or a batch of same-shape matrices) whose update one owner computes.

    Attributes:
        name: unique, stable name (the parameter's name); plans are keyed by it.
        shape: ``(m, n)``, or ``(*batch, m, n)`` for a stack of matrices that is
            orthogonalised as one batch (e.g. ``(experts, m, n)``).
        dtype: dtype of the tensors communicated for it (default fp32).
        layer: layer or group key; items with the same key are spread over
            different owners and small ones are packed together (see
            :func:`~dmuon.comm.plan_owners`). ``None``: the item is its own group.

    Examples:
        >>> import torch
        >>> item = MatrixItem("layers.0.mlp.fc", (3072, 768), torch.bfloat16, layer="layers.0")
        >>> item.rows, item.cols, item.batch, item.numel, item.nbytes
        (3072, 768, 1, 2359296, 4718592)
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    layer: str | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"item name must be a non-empty string, got {self.name!r}")
        try:
            shape = tuple(self.shape)
        except TypeError:  # None, an int: not a sequence of dimensions
            shape = ()
        if len(shape) < 2 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise ValueError(
                f"item {self.name!r}: shape must be (m, n) or (*batch, m, n) of ints ≥ 0, "
                f"got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", _as_dtype(self.dtype, self.name))
        if self.layer is not None:
            object.__setattr__(self, "layer", str(self.layer))

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor, layer: str | None = None) -> MatrixItem:
        """The item describing ``tensor`` (its shape and dtype).

        Examples:
            >>> import torch
            >>> MatrixItem.from_tensor("w", torch.zeros(4, 8)).shape
            (4, 8)
        """
        return cls(name, tuple(tensor.shape), tensor.dtype, layer)

    @property
    def rows(self) -> int:
        """``m``, the second-to-last dimension."""
        return self.shape[-2]

    @property
    def cols(self) -> int:
        """``n``, the last dimension."""
        return self.shape[-1]

    @property
    def batch(self) -> int:
        """Number of ``m × n`` matrices (product of the leading dimensions)."""
        return math.prod(self.shape[:-2])

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole item in :attr:`dtype`."""
        return self.numel * self.element_size

    @property
    def group(self) -> str:
        """The key items are grouped by: :attr:`layer`, or the item's own name."""
        return self.layer if self.layer is not None else f"\0{self.name}"


_LAYER_INDEX = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_key(name: str) -> str:
    """The default layer key of a parameter name.

    The prefix up to the first numeric component (``"model.layers.3.mlp.up.weight"``
    → ``"model.layers.3"``), which is the transformer block in the usual naming of
    ``nn.ModuleList`` stacks; a name without a numeric component is grouped by its
    parent module (``"encoder.proj.weight"`` → ``"encoder.proj"``).

    Examples:
        >>> layer_key("model.layers.12.self_attn.k_proj.weight")
        'model.layers.12'
        >>> layer_key("lm_head.weight")
        'lm_head'
    """
    match = _LAYER_INDEX.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def matrix_items(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    layer_of: Callable[[str], str | None] = layer_key,
    dtype: torch.dtype | None = None,
) -> list[MatrixItem]:
    """Items for named tensors with at least two dimensions (others are skipped).

    Args:
        named_tensors: e.g. ``model.named_parameters()``.
        layer_of: maps a name to its layer key; default :func:`layer_key`.
        dtype: dtype to communicate in; default each tensor's own dtype.

    Examples:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> for item in matrix_items(model.named_parameters()):  # biases are not matrices
        ...     print(item.name, item.shape, item.layer)
        0.weight (16, 8) 0
        1.weight (4, 16) 1
    """
    out = []
    for name, t in named_tensors:
        if t.dim() >= 2:
            out.append(MatrixItem(name, tuple(t.shape), dtype or t.dtype, layer_of(name)))
    return out
