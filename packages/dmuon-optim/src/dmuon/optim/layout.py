"""How one parameter is seen as a batch of matrices.

Every parameter of a matrix group is first viewed as ``(L, M, N)``:

* 2-D ``(M, N)`` → ``L = 1``;
* ``flatten=True`` (conv weights ``(out, in, *kernel)``) → ``(1, out, in·∏kernel)``,
  one matrix per parameter (never across parameters);
* ``flatten=False`` (expert stacks ``(E, m, n)``, any ``(..., m, n)``) →
  ``(∏leading, m, n)``, a batch of matrices;
* ``transposed=True`` (a 2-D weight stored ``(in, out)``, Hugging Face's ``Conv1D`` of
  GPT-2) → ``(1, out, in)``: the matrix is its transpose, so that its rows are its output
  neurons as a rule expects (row statistics, ``adjust_lr``, row selections, and the
  blocks below). Its views (:meth:`MatrixLayout.block_view`) are transposed views of the
  parameter, and its state is seen in the parameter's own shape
  (:meth:`MatrixLayout.state_view`: a transposed view of the rule's ``(m, n)`` state).
  With ``flatten=True`` it is for a conv weight stored ``(in, out, *kernel)``
  (``nn.ConvTranspose1d/2d/3d`` with ``groups=1``) → ``(1, out, in·∏kernel)``: dims 0 and
  1 swapped before flattening, so that the rows are the output channels, as of an
  ``nn.Conv`` weight. A stride-1 transposed convolution *is* the convolution whose
  weight is ``w.transpose(0, 1)`` with its kernel flipped, and a flip permutes the
  columns, which the polar factor follows; flattened as stored, ``(in, out·kernel)``, it
  would be orthogonalised as a different matrix, its row statistics taken over input
  channels and its ``adjust_lr`` shape factor that of other dimensions.

Then its ``M`` rows are cut into *blocks*: ``split_sizes`` (fused QKV) gives
consecutive row blocks, and ``num_heads`` splits each block's rows into per-head
matrices. A block of ``rows`` rows with ``heads`` heads contributes
``L·heads`` matrices of shape ``(rows/heads, N)``. Consecutive blocks with the same
matrix shape are merged, so an equal three-way QKV split of ``(3d, d)`` is a single
block of three ``d × d`` matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Block", "MatrixLayout", "matrix_layout"]


@dataclass(frozen=True)
class Block:
    """A run of same-shape matrices inside a parameter's ``(L, M, N)`` view.

    Attributes:
        row_start: first row of the block.
        rows: rows of the block (``heads × matrix_rows``).
        heads: matrices per leading index.
        matrix_rows: rows of each matrix.

    Examples:
        >>> import torch
        >>> from dmuon.optim import matrix_layout
        >>> qkv = torch.nn.Parameter(torch.zeros(96, 32))  # fused Q, K, V with 4 heads each
        >>> layout = matrix_layout(qkv, {"num_heads": 4, "split_sizes": (32, 32, 32)}, "qkv")
        >>> layout.blocks[0]  # same-shape blocks merge: 3 × 4 heads of 8 × 32
        Block(row_start=0, rows=96, heads=12, matrix_rows=8)
    """

    row_start: int
    rows: int
    heads: int
    matrix_rows: int


@dataclass(frozen=True)
class MatrixLayout:
    """A parameter seen as blocks of matrices (see the module docstring).

    Attributes:
        param_shape: the parameter's shape.
        flat: the ``(L, M, N)`` view.
        blocks: the row blocks, in row order.
        flatten: the ``flatten`` setting the layout was made with.
        transposed: the parameter is stored ``(in, out)`` (or ``(in, out, *kernel)``) and
            seen as its transpose (the group key ``transposed``); then ``flat`` is
            ``(1, out, in)`` (``(1, out, in·kernel)``).

    Examples:
        >>> import torch
        >>> from dmuon.optim import matrix_layout
        >>> experts = torch.nn.Parameter(torch.zeros(4, 64, 32))  # a 3-D expert stack
        >>> layout = matrix_layout(experts, {"flatten": False}, "experts")
        >>> layout.flat, layout.whole, layout.count(layout.blocks[0])
        ((4, 64, 32), True, 4)
    """

    param_shape: tuple[int, ...]
    flat: tuple[int, int, int]
    blocks: tuple[Block, ...]
    flatten: bool | None
    transposed: bool = False

    @property
    def whole(self) -> bool:
        """One block covering every row and the parameter stored as the rule sees it: the
        parameter is one contiguous batch (never for a ``transposed`` one)."""
        return len(self.blocks) == 1 and not self.transposed

    @property
    def stacks(self) -> bool:
        """One block covering every row: the parameter's matrices are one run of a bucket's
        batch, so its state can be a slice of the bucket's stacked buffers
        (:meth:`state_view`), ``transposed`` or not."""
        return len(self.blocks) == 1

    def state_view(self, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The parameter's state seen in ``shape`` from its contiguous slice ``t`` of a
        stacked buffer (``(count, m, n)`` matrix state or ``(count, m)`` row state).

        ``shape`` is the parameter's shape (matrix state) or :attr:`row_state_shape`. For a
        ``transposed`` layout, matrix state is ``t`` seen ``(out, in)`` and transposed: a
        view in the parameter's ``(in, out)`` shape whose columns are the rule's rows, so
        that the rule updates the buffer in place and the parameter's state is current
        (no copy in or out; its strides are those of a transposed matrix).

        Examples:
            >>> import torch
            >>> c_attn = torch.zeros(8, 24)  # (in, out), q|k|v by columns
            >>> lay = matrix_layout(c_attn, {"transposed": True, "split_sizes": (8, 8, 8)}, "c")
            >>> buf = torch.arange(3 * 8 * 8.0).view(3, 8, 8)  # the rule's three (8, 8)
            >>> v = lay.state_view(buf, (8, 24))
            >>> v.shape, v.data_ptr() == buf.data_ptr(), bool((v[:, 8:16] == buf[1].T).all())
            (torch.Size([8, 24]), True, True)
        """
        if self.transposed and len(shape) >= 2:  # matrix state (row state is 1-D)
            return t.view(shape[1], shape[0], *shape[2:]).transpose(0, 1)
        return t.view(shape)

    def count(self, block: Block) -> int:
        """Number of matrices in ``block``."""
        return self.flat[0] * block.heads

    def matrix_shape(self, block: Block) -> tuple[int, int]:
        """``(m, n)`` of the matrices in ``block``."""
        return (block.matrix_rows, self.flat[2])

    @property
    def row_state_shape(self) -> tuple[int, ...]:
        """Shape of per-row state for the whole parameter (one value per row of every matrix)."""
        if self.flatten or len(self.param_shape) == 2:
            return (self.flat[1],)
        return tuple(self.param_shape[:-1])

    def block_view(self, t: torch.Tensor, block: Block) -> torch.Tensor:
        """A view of ``block`` in the parameter-shaped ``t``: ``(L, heads, rows, N)``.

        For a whole-parameter block on a contiguous tensor this is contiguous and
        ``.view(count, rows, N)`` is free. For a ``transposed`` layout it is a view of
        ``t.transpose(0, 1)``: writing into it writes the parameter's columns. A transposed
        conv weight's is ``(L, heads, rows, in, *kernel)``: its ``N = in·kernel`` columns do
        not merge into one dimension of a view (``in`` is the outer dimension in memory), so
        callers ``reshape`` it, as they do every view, to ``(count, rows, N)``. ``t`` may
        come in another shape of the same elements (``sharded`` mode's gathered gradients
        are ``(dim0, rest)``): it is seen in the parameter's shape first.
        """
        L, M, N = self.flat
        if self.transposed:
            if tuple(t.shape) != self.param_shape:
                t = t.view(self.param_shape)
            v = t.transpose(0, 1).unsqueeze(0)
        else:
            v = t.view(L, M, N)
        if block.rows != M:
            v = v.narrow(1, block.row_start, block.rows)
        return v.unflatten(1, (block.heads, block.matrix_rows))

    def row_block_view(self, t: torch.Tensor, block: Block) -> torch.Tensor:
        """A view of ``block`` in per-row state ``t``: ``(L, heads, rows)``."""
        L, M, _ = self.flat
        v = t.view(L, M)
        if block.rows != M:
            v = v.narrow(1, block.row_start, block.rows)
        return v.unflatten(1, (block.heads, block.matrix_rows))


def _flat_shape(
    shape: tuple[int, ...], flatten: bool | None, where: str, transposed: bool = False
) -> tuple[int, int, int]:
    if transposed and (len(shape) < 2 or (len(shape) > 2 and flatten is not True)):
        raise ValueError(
            f"{where} has shape {shape} ({len(shape)}-D) and flatten={flatten}; the group key "
            "'transposed' is for 2-D weights stored (in, out), as Hugging Face's Conv1D stores "
            "them, and, with flatten=True, for conv weights stored (in, out, *kernel), as "
            "nn.ConvTranspose (groups=1) stores them; give this parameter a group without it"
        )
    if transposed:  # (in, out, *kernel) → (out, in·kernel): rows are the output neurons
        return (1, shape[1], shape[0] * math.prod(shape[2:]))
    if len(shape) < 2:
        shown = "" if "shape" in where else f" (shape {shape})"  # where may name it already
        raise ValueError(
            f"{where} is {len(shape)}-D{shown}; matrix rules take parameters with "
            "at least 2 dimensions. Put 0-D and 1-D parameters (biases, norms, scalars) in a "
            "group with rule 'adamw' or 'lion' — dmuon.optim.param_groups(model) does this"
        )
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if flatten is None:
        raise ValueError(
            f"{where} has shape {shape} ({len(shape)}-D); say how to see it as matrices with "
            "the group key 'flatten': True for a conv weight (one (out, in·kernel) matrix), "
            "False for a stack of matrices over the leading dimensions (MoE experts)"
        )
    if flatten:
        return (1, shape[0], math.prod(shape[1:]))
    return (math.prod(shape[:-2]), shape[-2], shape[-1])


def matrix_layout(param: torch.Tensor, group: dict[str, Any], where: str) -> MatrixLayout:
    """The :class:`MatrixLayout` of ``param`` under the group keys ``flatten``, ``transposed``,
    ``split_sizes`` and ``num_heads``.

    Args:
        param: the parameter.
        group: its (normalised) group.
        where: how to name the parameter in errors.

    Raises:
        ValueError: a 0-/1-D parameter, a >2-D one without ``flatten`` (or with
            ``transposed`` and ``flatten`` not ``True``), split sizes
            that do not sum to the rows, or heads that do not divide a block.

    Examples:
        >>> import torch
        >>> qkv = torch.zeros(3 * 64, 64)
        >>> lay = matrix_layout(qkv, {"split_sizes": (64, 64, 64), "num_heads": 4}, "qkv")
        >>> tuple((lay.count(b), lay.matrix_shape(b)) for b in lay.blocks)
        ((12, (16, 64)),)
        >>> c_attn = torch.zeros(64, 3 * 64)  # GPT-2's Conv1D: (in, out), q|k|v by columns
        >>> lay = matrix_layout(c_attn, {"transposed": True, "split_sizes": (64, 64, 64)}, "c")
        >>> lay.flat, tuple((lay.count(b), lay.matrix_shape(b)) for b in lay.blocks)
        ((1, 192, 64), ((3, (64, 64)),))
        >>> up = torch.zeros(16, 8, 3, 3)  # nn.ConvTranspose2d(16, 8, 3): (in, out, *kernel)
        >>> matrix_layout(up, {"transposed": True, "flatten": True}, "up").flat  # (out, in·k)
        (1, 8, 144)
    """
    shape = tuple(param.shape)
    flatten = group.get("flatten")
    transposed = bool(group.get("transposed"))
    L, M, N = _flat_shape(shape, flatten, where, transposed)
    split = group.get("split_sizes") or (M,)
    if sum(split) != M:
        raise ValueError(
            f"{where}: split_sizes {tuple(split)} sum to {sum(split)} but the matrix has {M} "
            f"rows (shape {shape}); they must sum to {M}"
        )
    heads = group.get("num_heads") or 1
    heads_per_block = (heads,) * len(split) if isinstance(heads, int) else tuple(heads)
    if len(heads_per_block) != len(split):
        raise ValueError(
            f"{where}: num_heads {heads} gives {len(heads_per_block)} head counts for "
            f"{len(split)} split blocks; give one int or one per block"
        )
    blocks: list[Block] = []
    start = 0
    for rows, h in zip(split, heads_per_block, strict=True):
        if rows % h:
            raise ValueError(
                f"{where}: a block of {rows} rows cannot be cut into {h} heads (shape {shape}, "
                f"split_sizes {tuple(split)}); num_heads must divide every block's rows"
            )
        d = rows // h
        prev = blocks[-1] if blocks else None
        if prev is not None and prev.matrix_rows == d and prev.row_start + prev.rows == start:
            blocks[-1] = Block(prev.row_start, prev.rows + rows, prev.heads + h, d)
        else:
            blocks.append(Block(start, rows, h, d))
        start += rows
    if L == 0 or N == 0 or M == 0:
        blocks = []
    return MatrixLayout(shape, (L, M, N), tuple(blocks), flatten, transposed)
