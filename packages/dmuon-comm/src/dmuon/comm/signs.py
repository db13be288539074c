"""Sign packing: 8 signs per byte, or 5 votes in ``{−1, 0, +1}`` per byte.

Signs (:func:`pack_signs`): an entry ``x`` is *positive* when ``x ≥ 0`` — zero
(``+0.0`` and ``−0.0``) counts as ``+1`` — and negative otherwise (NaN counts as ``−1``,
since ``NaN ≥ 0`` is false): one bit holds two values. Entry ``k`` of the flattened
tensor is bit ``k mod 8`` (least significant first) of byte ``k // 8``; a set bit means
``+1``. Bits past the last entry are set (``+``) and ignored by :func:`unpack_signs`.

Votes (:func:`pack_votes`): :func:`~dmuon.comm.majority_vote` needs a third value,
``sign(0) = 0`` (a zero abstains). Entry ``k`` is base-3 digit ``k mod 5`` (least
significant first) of byte ``k // 5``, the digit being ``vote + 1``; ``3^5 = 243`` codes
fit a byte, so a vote costs 1.6 bits. Votes past the last entry abstain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "ABSTAIN",
    "VOTES_PER_BYTE",
    "pack_signs",
    "pack_votes",
    "ternary_signs",
    "unpack_signs",
    "unpack_votes",
]

VOTES_PER_BYTE = 5
"""Votes in ``{−1, 0, +1}`` per byte of :func:`pack_votes` (``3^5 = 243 ≤ 256``)."""

_POWERS = tuple(3**i for i in range(VOTES_PER_BYTE))

ABSTAIN = sum(_POWERS)
"""The byte of five abstentions (every digit ``0 + 1``): :func:`pack_votes`' padding."""


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``(k, 8)`` uint8 zeros and ones → ``k`` bytes, column ``i`` into bit ``i``."""
    out = bits[:, 0].clone()
    for i in range(1, 8):
        out |= bits[:, i] << i
    return out


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """``(..., k)`` bytes → ``(..., k, 8)`` uint8 zeros and ones, bit ``i`` in column ``i``."""
    out = torch.empty(*packed.shape, 8, dtype=torch.uint8, device=packed.device)
    for i in range(8):
        torch.bitwise_and(packed >> i, 1, out=out[..., i])
    return out


_SIGN_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _sign_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(256, 8)``: row ``b`` holds the eight ``±1`` signs packed in byte ``b``."""
    key = (dtype, device)
    if key not in _SIGN_TABLES:
        codes = torch.arange(256, dtype=torch.uint8, device=device)
        _SIGN_TABLES[key] = plus_minus(unpack_bits(codes), dtype)
    return _SIGN_TABLES[key]


def plus_minus(plus: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``+1`` where ``plus`` is true (or 1), ``−1`` elsewhere, in ``dtype``.

    Arithmetic rather than ``torch.where`` with scalars, which is several times
    slower on CPU.
    """
    return plus.to(dtype).mul_(2).sub_(1)


def _byte_rows(x: torch.Tensor, per_byte: int, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` flattened, and the ``(ceil(numel/per_byte), per_byte)`` uint8 rows of ones that
    :func:`pack_signs` and :func:`pack_votes` fill with its first ``numel`` entries (row
    ``b``: the entries of byte ``b``).

    The ones past the last entry are both packings' padding: a set bit (``+``) for signs,
    the digit ``0 + 1`` of an abstention for votes. ``op`` names the caller in the error.

    Raises:
        ValueError: ``x`` is complex or boolean (no sign to pack).
    """
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{op} needs a real numeric tensor, got dtype {x.dtype}")
    flat = x.reshape(-1)
    nbytes = -(-flat.numel() // per_byte)
    return flat, torch.ones(nbytes, per_byte, dtype=torch.uint8, device=x.device)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of ``x`` as a 1-D uint8 tensor of ``ceil(numel/8)`` bytes, 8 signs per byte.

    ``bit = 1`` for ``x ≥ 0`` (zero counts as ``+``), ``0`` for ``x < 0``; entry ``k``
    of ``x.flatten()`` is bit ``k % 8`` (LSB first) of byte ``k // 8``.

    Args:
        x: a real tensor of any shape and memory layout.

    Raises:
        ValueError: ``x`` is complex or boolean.

    Examples:
        >>> import torch
        >>> pack_signs(torch.tensor([1.0, -2.0, 0.0, -0.0, -1.0, 3.0, -5.0, 7.0, -1.0]))
        tensor([173, 254], dtype=torch.uint8)
    """
    flat, bits = _byte_rows(x, 8, "pack_signs")
    torch.ge(flat, 0, out=bits.view(-1)[: flat.numel()])
    return pack_bits(bits)


def unpack_signs(
    bits: torch.Tensor, shape: Sequence[int], *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``±1`` tensor of ``shape`` whose signs :func:`pack_signs` packed into ``bits``.

    Args:
        bits: 1-D uint8 tensor with at least ``ceil(prod(shape)/8)`` bytes.
        shape: shape of the result.
        dtype: dtype of the result (``+1``/``−1`` values).

    Raises:
        ValueError: ``bits`` is not 1-D uint8 or is too short for ``shape``.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[0.5, -1.0, 0.0], [-3.0, 2.0, -0.1]])
        >>> unpack_signs(pack_signs(x), x.shape)
        tensor([[ 1., -1.,  1.],
                [-1.,  1., -1.]])
    """
    # One row of a 256-entry table per byte: a gather instead of eight shifts.
    return _unpacked(bits, shape, _sign_table(dtype, bits.device), "bits", "signs")


def ternary_signs(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sign(x)`` in ``dtype``: ``+1``, ``0`` or ``−1`` per entry; NaN gives ``0``.

    Examples:
        >>> import torch
        >>> ternary_signs(torch.tensor([2.0, -0.0, float("nan"), -3.0]), torch.int8)
        tensor([ 1,  0,  0, -1], dtype=torch.int8)
    """
    signs = torch.sign(x)
    if signs.is_floating_point():
        signs.nan_to_num_(0.0)  # torch.sign keeps NaN, which no integer holds
    return signs.to(dtype)


def pack_votes(x: torch.Tensor) -> torch.Tensor:
    """The signs of ``x`` (``sign(0) = 0``; NaN abstains too) as a 1-D uint8 tensor of
    ``ceil(numel/5)`` bytes, five per byte in base 3.

    Entry ``k`` of ``x.flatten()`` is digit ``k % 5`` (least significant first) of byte
    ``k // 5``, the digit being ``sign + 1``; entries past the last abstain.

    Args:
        x: a real tensor of any shape and memory layout.

    Raises:
        ValueError: ``x`` is complex or boolean.

    Examples:
        >>> import torch
        >>> pack_votes(torch.tensor([1.0, -2.0, 0.0, 3.0, -1.0, 0.5]))  # 2+0+9+54+0, 2+3+9+27+81
        tensor([ 65, 122], dtype=torch.uint8)
    """
    flat, digits = _byte_rows(x, VOTES_PER_BYTE, "pack_votes")
    # the digit sign + 1: 1 + (−1 as 255) wraps to 0
    digits.view(-1)[: flat.numel()] += ternary_signs(flat, torch.int8).view(torch.uint8)
    out = digits[:, 0].clone()
    for i in range(1, VOTES_PER_BYTE):
        out.add_(digits[:, i], alpha=_POWERS[i])  # ≤ 2·(1 + 3 + 9 + 27 + 81) = 242
    return out


_VOTE_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _vote_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(256, 5)``: row ``b`` holds the five votes packed in byte ``b`` (rows past 242,
    which :func:`pack_votes` never writes, abstain)."""
    key = (dtype, device)
    if key not in _VOTE_TABLES:
        codes = torch.arange(256, device=device)
        digits = torch.stack([codes // p % 3 for p in _POWERS], dim=-1) - 1
        digits[3**VOTES_PER_BYTE :] = 0
        _VOTE_TABLES[key] = digits.to(dtype)
    return _VOTE_TABLES[key]


def unpack_votes(
    packed: torch.Tensor, shape: Sequence[int], *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``{−1, 0, +1}`` tensor of ``shape`` whose votes :func:`pack_votes` packed.

    Args:
        packed: 1-D uint8 tensor with at least ``ceil(prod(shape)/5)`` bytes.
        shape: shape of the result.
        dtype: dtype of the result.

    Raises:
        ValueError: ``packed`` is not 1-D uint8 or is too short for ``shape``.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[0.5, -1.0, 0.0], [-3.0, 2.0, -0.0]])
        >>> unpack_votes(pack_votes(x), x.shape)
        tensor([[ 1., -1.,  0.],
                [-1.,  1.,  0.]])
    """
    # one row of a 256-entry table per byte: a gather instead of five divisions
    return _unpacked(packed, shape, _vote_table(dtype, packed.device), "packed", "votes")


def _unpacked(
    packed: torch.Tensor, shape: Sequence[int], table: torch.Tensor, arg: str, what: str
) -> torch.Tensor:
    """The entries of ``shape`` held by 1-D uint8 ``packed``, row ``b`` of ``table`` being
    the entries of byte ``b`` (``arg`` and ``what``: the argument and its entries, for the
    errors)."""
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(
            f"shape must have no negative size (the packed bytes do not say how many "
            f"{what} they hold: give every dimension), got {shape}"
        )
    n = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(
            f"{arg} must be a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    per_byte = table.shape[1]
    if packed.numel() * per_byte < n:
        raise ValueError(
            f"{arg} holds {packed.numel() * per_byte} {what} but shape {shape} needs {n} "
            f"(≥ {-(-n // per_byte)} bytes)"
        )
    return torch.index_select(table, 0, packed.to(torch.int32)).reshape(-1)[:n].reshape(shape)
