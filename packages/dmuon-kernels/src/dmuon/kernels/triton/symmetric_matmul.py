"""The one Triton kernel behind ``syrk``, ``sym_poly`` and ``sym_mul``.

It computes, for every matrix of a batch,

    C = α · A·B + β · A + δ · I        (A: m × k, B: k × m, C: m × m)

when the caller knows ``A·B`` is symmetric: ``B = Aᵀ`` (``X Xᵀ``), ``B = A`` with
``A`` symmetric (``A²``), or ``A`` and ``B`` commuting symmetric matrices. Only the
``T(T+1)/2`` tiles on or below the diagonal are computed (``T = ⌈m / BLOCK⌉``);
each is stored in place and transposed into its mirror above the diagonal, so
about half the multiply–adds of a full GEMM are done (flash-muon's ``mmt_kernel``,
microsoft/dion ``ns_line_1``/``ns_line_2``, Dao-AILab ``gemm_symmetric``). On a
diagonal tile the element ``(i, j)``, ``i > j``, is written to both ``(i, j)`` and
``(j, i)`` and the upper half of the tile is never stored, so the result is
exactly symmetric and no two stores race on one address.

Accumulation is in fp32; α, β and δ are applied in fp32 and the sum is rounded
once to the output dtype, as cuBLAS does for ``baddbmm``. fp32 operands use IEEE
products unless ``torch.backends.cuda.matmul.allow_tf32`` is set (torch's own
rule). Batch and row offsets are computed in int64: a ``(320, 2560, 3072)``
batch already spans more than 2³¹ elements.

Under the Triton interpreter (``TRITON_INTERPRET=1`` when this module is first
imported) the loaded tiles are converted to fp32 before the product: the
interpreter's numpy arithmetic on bf16 is wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "dmuon.kernels.triton needs Triton: pip install 'dmuon-kernels[triton]'"
    ) from exc

from dmuon.kernels.triton._configs import AMPERE, HOPPER, INTERPRETER, TileConfig, select_configs

__all__ = [
    "INTERPRETING",
    "SUPPORTED_DTYPES",
    "as_batch",
    "check_operand",
    "check_out",
    "lower_tile_count",
    "lower_tile_matmul",
]

# Read once, like @triton.jit does when it decides between compiling and interpreting.
INTERPRETING: bool = bool(triton.knobs.runtime.interpret)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_ALL_CONFIGS: tuple[TileConfig, ...] = INTERPRETER if INTERPRETING else HOPPER + AMPERE


def _to_triton(c: TileConfig):
    return triton.Config(
        {"BLOCK": c.block, "BLOCK_K": c.block_k}, num_warps=c.num_warps, num_stages=c.num_stages
    )


def _prune(configs, named_args, **kwargs):
    """Keep the configs of this GPU's generation that fit its shared memory (see _configs)."""
    if INTERPRETING:
        return configs
    out = named_args["C"]
    capability = torch.cuda.get_device_capability(out.device)
    wanted = select_configs(capability, named_args["M"], out.element_size())
    keep = [
        c
        for c in configs
        if TileConfig(c.kwargs["BLOCK"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) in wanted
    ]
    return keep or configs[:1]


@triton.jit
def _accumulate(
    acc, a_ptrs, b_ptrs, rm, rn, rk, M, k_left, UPCAST: tl.constexpr, PRECISION: tl.constexpr
):
    """acc + A[rm, k-slab] · B[k-slab, rn]; rows/columns past M and k past k_left read 0."""
    a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
    b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < M), other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.autotune(
    configs=[_to_triton(c) for c in _ALL_CONFIGS],
    key=["M", "K", "HAS_BETA", "HAS_DIAG", "PRECISION"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _lower_tile_kernel(
    A,
    B,
    C,
    M,
    K,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bk,
    stride_bn,
    stride_cb,
    stride_cm,
    stride_cn,
    alpha,
    beta,
    diag,
    HAS_BETA: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_per_side = tl.cdiv(M, BLOCK)
    tiles = tiles_per_side * (tiles_per_side + 1) // 2
    batch = (pid // tiles).to(tl.int64)
    t = pid % tiles
    # Lower-triangle tile t (row-major over i ≥ j) -> (i, j); the float square root can
    # be one off near perfect squares, the two corrections make it exact.
    i = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
    j = t - i * (i + 1) // 2

    rm = i * BLOCK + tl.arange(0, BLOCK)
    rn = j * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    a_ptrs = A + batch * stride_ab + rm64[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + batch * stride_bb + rk[:, None] * stride_bk + rn64[None, :] * stride_bn
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    if UPCAST:
        # The interpreter (UPCAST is set there): Triton 3.6 hands the kernel K as a
        # one-element array, which numpy >= 2.4 refuses as a range() bound (Triton 3.7
        # squeezes it); a while loop only takes its truth value. Compiled kernels keep
        # the for loop, which Triton software-pipelines.
        k0 = 0
        while k0 < K:
            acc = _accumulate(acc, a_ptrs, b_ptrs, rm, rn, rk, M, K - k0, UPCAST, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            k0 += BLOCK_K
    else:
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            acc = _accumulate(acc, a_ptrs, b_ptrs, rm, rn, rk, M, k_left, UPCAST, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    acc = acc * alpha
    inside = (rm[:, None] < M) & (rn[None, :] < M)
    if HAS_BETA:  # β·A on this tile; A is square here
        a_tile = A + batch * stride_ab + rm64[:, None] * stride_am + rn64[None, :] * stride_ak
        acc += beta * tl.load(a_tile, mask=inside, other=0.0).to(tl.float32)
    if HAS_DIAG:
        acc += tl.where(rm[:, None] == rn[None, :], diag, 0.0)
    result = acc.to(C.dtype.element_ty)

    c_base = C + batch * stride_cb
    lower = inside & (rm[:, None] >= rn[None, :])
    tl.store(c_base + rm64[:, None] * stride_cm + rn64[None, :] * stride_cn, result, mask=lower)
    # Mirror: element (r, s) with r > s goes to (s, r). Stored from the transposed tile
    # so the writes stay contiguous along the row.
    upper = (rn[:, None] < M) & (rm[None, :] < M) & (rn[:, None] < rm[None, :])
    mirror = c_base + rn64[:, None] * stride_cm + rm64[None, :] * stride_cn
    tl.store(mirror, tl.trans(result), mask=upper)


def as_batch(T: torch.Tensor) -> torch.Tensor:
    """A 2-D matrix as a batch of one (a view); 3-D unchanged."""
    return T if T.ndim == 3 else T.unsqueeze(0)


def lower_tile_count(m: int, block: int) -> int:
    """Number of tiles the kernel computes for an ``m × m`` output: ``T(T+1)/2``."""
    t = -(-m // block)
    return t * (t + 1) // 2


def check_operand(
    name: str, T: object, *, op: str, square: bool, what: str = "(m, k) matrix or (B, m, k) batch"
) -> torch.Tensor:
    """Raise a ValueError naming the operand, its shape/dtype/device and what is expected."""
    if not isinstance(T, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(T).__name__}")
    if T.ndim not in (2, 3):
        raise ValueError(f"{op}: {name} must be a {what}, got shape {tuple(T.shape)}")
    if square and T.shape[-1] != T.shape[-2]:
        raise ValueError(f"{op}: {name} must be square (..., m, m), got shape {tuple(T.shape)}")
    if T.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{op}: {name} must be float16, bfloat16 or float32, got {T.dtype}; cast it or "
            "use the torch form in dmuon.kernels.symmetric_ops"
        )
    if T.device.type != "cuda" and not INTERPRETING:
        raise ValueError(
            f"{op}: {name} is on {T.device}; the Triton kernels need a CUDA tensor (set "
            "TRITON_INTERPRET=1 before dmuon.kernels.triton is first imported to run them "
            "on the CPU in Triton's interpreter)"
        )
    if not T.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous, got strides {T.stride()} for shape "
            f"{tuple(T.shape)}; call .contiguous() first"
        )
    return T


def check_out(
    out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...], op: str
) -> torch.Tensor | None:
    """Check a caller's ``out`` buffer against the result's shape, dtype and device."""
    if out is None:
        return None
    if (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != shape
        or out.dtype != like.dtype
        or out.device != like.device
        or not out.is_contiguous()
    ):
        got = (
            f"shape {tuple(out.shape)}, {out.dtype} on {out.device}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise ValueError(
            f"{op}: out must be a contiguous tensor of shape {shape}, {like.dtype} on "
            f"{like.device}; got {got}"
        )
    return out


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges spanned by two tensors intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def lower_tile_matmul(
    A: torch.Tensor,
    B: torch.Tensor,
    *,
    alpha: float,
    beta: float,
    diag: float,
    out: torch.Tensor | None,
    op: str,
) -> torch.Tensor:
    """Launch the kernel on checked 3-D operands: ``A (Bt, m, k)``, ``B (Bt, k, m)`` (any strides).

    ``out`` (checked with :func:`check_out`) or a new tensor of shape ``(Bt, m, m)``
    receives the result.
    """
    batch, m, k = A.shape
    C = torch.empty((batch, m, m), dtype=A.dtype, device=A.device) if out is None else out
    if _overlaps(C, A) or _overlaps(C, B):
        raise ValueError(f"{op}: out must not share memory with the inputs")
    if batch == 0 or m == 0:
        return C
    smallest = min(c.block for c in _ALL_CONFIGS)
    programs = batch * lower_tile_count(m, smallest)
    if programs >= 2**31:
        raise ValueError(
            f"{op}: a batch of {batch} matrices of size {m} needs {programs} programs, more "
            "than a launch grid holds (2³¹ − 1); split the batch"
        )
    fp32_tf32 = A.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    precision = "tf32" if fp32_tf32 else "ieee"

    def grid(meta):
        return (batch * lower_tile_count(m, meta["BLOCK"]),)

    if A.device.type == "cuda" and A.device.index != torch.cuda.current_device():
        # Triton launches on the current device's stream: make the operands' device
        # current for a tensor on another GPU (and for the autotuner's timing runs)
        with torch.cuda.device(A.device):
            _launch(grid, A, B, C, m, k, alpha, beta, diag, precision)
    else:
        _launch(grid, A, B, C, m, k, alpha, beta, diag, precision)
    return C


def _launch(
    grid: Callable[[dict], tuple[int]],
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    m: int,
    k: int,
    alpha: float,
    beta: float,
    diag: float,
    precision: str,
) -> None:
    """One launch of the kernel on the current device's stream."""
    _lower_tile_kernel[grid](
        A,
        B,
        C,
        m,
        k,
        A.stride(0),
        A.stride(1),
        A.stride(2),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        C.stride(0),
        C.stride(1),
        C.stride(2),
        float(alpha),
        float(beta),
        float(diag),
        HAS_BETA=beta != 0.0,
        HAS_DIAG=diag != 0.0,
        UPCAST=INTERPRETING,
        PRECISION=precision,
    )
