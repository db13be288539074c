"""Shared preparation for every Newton–Schulz entry point: checks, wide
orientation, scale-safe Frobenius normalisation, and the way back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmuon.kernels.compute_dtype import default_compute_dtype

MATRIX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes the Newton–Schulz entry points take. ``is_floating_point`` alone also lets
the float8 dtypes through, which have no ``amax`` on CPU and no matmul without scales: they
failed deep inside with a ``NotImplementedError``."""


def _is_dtensor(G: torch.Tensor) -> bool:
    """Whether ``G`` is a ``DTensor`` (a tensor laid out over a device mesh), told by what
    it has — its ``placements``, ``device_mesh`` and ``to_local`` — so that the kernels
    import nothing distributed (a torch built without distributed has no DTensor)."""
    return all(hasattr(G, a) for a in ("placements", "device_mesh", "to_local"))


def check_matrix_input(G: torch.Tensor, name: str = "G") -> None:
    """Raise a ValueError naming shape/dtype if ``G`` is not a real float batch of matrices.

    A ``DTensor`` is refused too: the kernels compute on the local storage with plain
    tensors (scales, norms, workspaces), which DTensor's dispatch refuses to mix with it
    ("got mixed torch.Tensor and DTensor") deep inside; the error says which tensor to
    pass instead.
    """
    if not isinstance(G, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(G).__name__}")
    if _is_dtensor(G):
        raise ValueError(
            f"{name} is a DTensor (placements {tuple(G.placements)}, global shape "  # type: ignore[attr-defined]
            f"{tuple(G.shape)}); the Newton–Schulz kernels take plain tensors: pass "
            f"{name}.full_tensor() (the whole matrix on every rank), or, for a matrix split "
            f"over a tensor-parallel group, its shard {name}.to_local() to "
            "dmuon.kernels.tp_gram_newton_schulz with a reduce over that group"
        )
    if G.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (a matrix or a batch (..., m, n)), "
            f"got shape {tuple(G.shape)}"
        )
    if G.dtype not in MATRIX_DTYPES:
        raise ValueError(
            f"{name} must be a real floating-point tensor (float16/bfloat16/float32/float64), "
            f"got dtype {G.dtype} with shape {tuple(G.shape)}"
            + (
                f"; cast it first, e.g. {name}.to(torch.bfloat16)"
                if G.dtype.is_floating_point
                else ""
            )
        )


def empty_result(G: torch.Tensor) -> torch.Tensor:
    """The result for an input with a zero-sized dimension: an empty tensor like ``G``."""
    check_matrix_input(G)
    return torch.zeros_like(G)


@dataclass(frozen=True)
class Layout:
    """How a batch was reshaped so it can be put back."""

    shape: torch.Size
    dtype: torch.dtype
    transposed: bool


def to_wide_normalized(
    G: torch.Tensor,
    eps: float,
    compute_dtype: torch.dtype | None,
    method: str,
    *,
    tall_in_place: bool = False,
) -> tuple[torch.Tensor, Layout]:
    """Return ``X`` of shape ``(B, m, n)`` with ``m ≤ n`` and ``‖X_b‖_F ≤ 1`` in the compute dtype.

    Normalisation happens in fp32 (or fp64 for fp64 input) *before* the cast down:
    fp16 overflows otherwise. Each matrix is first divided by its largest entry so
    the Frobenius norm neither overflows (entries ~1e30 square to inf in fp32) nor
    underflows (entries ~1e-30 square to 0); ``eps`` therefore acts relative to
    the largest entry,

        X = G / (‖G‖_F + eps · max|G|),

    which makes the result independent of the scale of ``G``. An absolute floor
    (``‖G‖_F + eps``) silently leaves small gradients un-orthogonalised. A zero
    matrix stays zero.

    Cost: three read-only reductions (``max G``, ``min G``, ``‖G/max|G|‖_F``) and two
    written passes; the transpose of a tall matrix and the casts ride on the writes
    (no separate ``contiguous``/``to`` copies, no ``|G|`` temporary).

    ``tall_in_place=True`` (the CPU torch path, see :func:`~dmuon.kernels.dispatch.run`):
    a tall matrix is not transposed in memory. ``X`` is then the wide-shaped view
    ``Yᵀ`` of a contiguous tall buffer ``Y`` (``X.mT`` is contiguous): the BLAS reads the
    transposed operand in place and the iterations write their products in the same
    layout (:func:`left_product`), so the result comes back in ``G``'s own layout.
    On a 2-core x86 CPU (one thread, fp32, torch 2.13) the transposing write of a
    2048 × 512 matrix took 4.3 ms against 0.8 ms for a plain one, and adding the
    transposed update to the weight 9.1 ms against 0.9 ms; the products cost the same
    in either layout and gave the same result to rounding. Ignored on the autograd path.
    """
    check_matrix_input(G)
    m, n = G.shape[-2], G.shape[-1]
    transposed = m > n
    grad = G.requires_grad and torch.is_grad_enabled()
    in_place = transposed and tall_in_place and not grad
    G3 = G.reshape(-1, m, n)
    if transposed and not in_place:
        G3 = G3.mT
    work = torch.float64 if G.dtype == torch.float64 else torch.float32
    if compute_dtype is None:
        compute_dtype = default_compute_dtype(G.device, method)
    # Three read-only reductions and two writes, each write fusing what it can:
    # max|G| = max(max G, −min G) reads G twice but materialises no |G| (on a 2-core x86
    # CPU, torch 2.13, vector_norm(ord=inf) of a (4, 384, 1536) fp32 batch took 15 ms,
    # amax + amin 0.8–1.4 ms); dividing by it upcasts, transposes to the wide
    # orientation and makes X contiguous in one write, so a tall matrix reduces in the
    # same memory order as its transpose (the same result to rounding: the products'
    # blocking differs); the division by the norm casts to the compute dtype on its store.
    dims = (-2, -1)
    scale = torch.maximum(G3.amax(dim=dims, keepdim=True), -G3.amin(dim=dims, keepdim=True))
    scale = torch.where(scale > 0, scale, 1.0).to(work)
    layout = Layout(G.shape, G.dtype, transposed)
    if grad:  # out= has no autograd: same arithmetic
        X = (G3.to(work) / scale).contiguous()
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps
        return (X / norm).to(compute_dtype), layout
    X = torch.empty(G3.shape, dtype=work, device=G.device)
    torch.div(G3, scale, out=X)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).add_(eps)
    if compute_dtype == work:
        X.div_(norm)
    else:
        X = torch.div(X, norm, out=torch.empty(X.shape, dtype=compute_dtype, device=G.device))
    return (X.mT if in_place else X), layout


def left_product(B: torch.Tensor, X: torch.Tensor, beta: float | None = None) -> torch.Tensor:
    """``B·X`` (``βX + B·X`` with ``beta``), returned in ``X``'s own layout.

    For the transposed view ``X = Yᵀ`` of :func:`to_wide_normalized` (``tall_in_place``;
    ``Y`` contiguous), the product is computed as its transpose, ``(Y·Bᵀ)ᵀ`` (``(βY +
    Y·Bᵀ)ᵀ``), into a fresh contiguous buffer: the result is again the transposed view of
    a contiguous tall matrix. Asking the BLAS to write a column-major ``out=`` instead
    gives the same values but, in bf16, leaves oneDNN's GEMM for a reference loop: on a
    2-core AMD EPYC with AVX-512 BF16 (torch 2.13, one thread), ``bmm(B, X,
    out=empty_like(X))`` of a 512 × 512 by 512 × 4096 bf16 product took 19.7 s against
    9.5 ms for ``(Y·Bᵀ)ᵀ`` (fp32: 21.5 ms either way). For a contiguous ``X``, or when
    autograd records, the plain product.
    """
    if X.is_contiguous() or (X.requires_grad and torch.is_grad_enabled()):
        return torch.bmm(B, X) if beta is None else torch.baddbmm(X, B, X, beta=beta)
    Y = X.mT
    Z = torch.bmm(Y, B.mT) if beta is None else torch.baddbmm(Y, Y, B.mT, beta=beta)
    return Z.mT


def restore(X: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Undo :func:`to_wide_normalized`'s transpose and reshape; cast to the input dtype."""
    if layout.transposed:
        X = X.mT
    return X.to(layout.dtype).reshape(layout.shape)
