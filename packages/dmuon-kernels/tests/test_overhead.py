"""One ``orthogonalize`` call runs the operators its algorithm needs and no more.

Counted, not timed: every ATen operator of the call is recorded with a
``TorchDispatchMode`` and sorted into matrix products, norms, copies and the other
passes over a whole ``m × n`` matrix. The expected counts are derived from the
iterations (docstrings of :mod:`dmuon.kernels.newton_schulz` and
:mod:`dmuon.kernels.gram_newton_schulz`) and from the normalisation (three reductions,
two written passes, ``_layout.to_wide_normalized``). An extra ``contiguous``, a cast
that could ride on a write, a second norm or a product too many fails here.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dmuon.kernels import orthogonalize

PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "matmul"}
NORMS = {"linalg_vector_norm", "norm", "frobenius_norm", "amax", "amin", "aminmax", "max"}
COPIES = {"copy_", "_to_copy", "clone", "contiguous"}
# no pass over the data: allocations (empty_like: the output buffer of a product that
# keeps a tall matrix's layout) and views
ALLOCATIONS_AND_VIEWS = ("empty", "empty_strided", "empty_like", "view", "t", "transpose")


class _Count(TorchDispatchMode):
    """Each operator call with the largest number of elements it reads or writes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        self.calls.append((name, max((t.numel() for t in tensors), default=0)))
        return out


def census(G: torch.Tensor, **kw) -> dict[str, Counter]:
    """Products, norms and copies of any size; other operators touching a whole matrix."""
    with _Count() as count:
        orthogonalize(G, backend="torch", **kw)
    whole = G.shape[-2] * G.shape[-1]
    matrices = G.numel() // whole  # one scalar per matrix (max|G|, the norm) is no pass
    kinds: dict[str, Counter] = {"products": Counter(), "norms": Counter(), "copies": Counter()}
    kinds["passes"] = Counter()
    for name, size in count.calls:
        if name in PRODUCTS:
            kinds["products"][name] += 1
        elif name in NORMS:
            kinds["norms"][name] += 1
        elif name in COPIES and size > matrices:
            kinds["copies"][name] += 1
        elif size >= whole and name not in ALLOCATIONS_AND_VIEWS:
            kinds["passes"][name] += 1
    return kinds


def standard_products(steps: int) -> Counter:
    # A = X Xᵀ (bmm), B = bA + cA² (one baddbmm), X ← aX + B X (one baddbmm) per step
    return Counter(bmm=steps, baddbmm=2 * steps)


def gram_products(steps: int, restarts: tuple[int, ...]) -> tuple[Counter, int]:
    """Products and copies of Gram Newton–Schulz, walked from its definition.

    ``R = X Xᵀ`` at the start and at each restart (bmm), ``X ← Q X`` at each restart and
    at the end (bmm); each iteration forms ``Z = bR + cR²`` (baddbmm), starts ``Q`` from
    ``aI + Z`` (one copy of ``Z``) or multiplies ``Q ← Q·Z + aQ`` (baddbmm), and, unless the
    next iteration restarts or it is the last, evolves ``R ← (aI + Z) R (aI + Z)`` (two
    baddbmm). The last iteration of a segment that starts ``Q`` forms ``Q`` directly
    (one baddbmm and no copy).
    """
    bmm, baddbmm, copies, q_started = 1, 0, 0, False
    for i in range(steps):
        if i in restarts and q_started:
            bmm += 2
            q_started = False
        evolve = i < steps - 1 and (i + 1) not in restarts
        baddbmm += 1  # Z, or Q = aI + bR + cR² directly
        if not q_started and evolve:
            copies += 1
        elif q_started:
            baddbmm += 1
        q_started = True
        if evolve:
            baddbmm += 2
    return Counter(bmm=bmm + 1, baddbmm=baddbmm), copies


# Normalisation: max|G| = max(max G, −min G) and ‖G / max|G|‖_F (three read-only
# reductions), G / max|G| and X / ‖·‖ (two written passes; the second is in place, or
# casts to the compute dtype on its store).
NORMALISE_NORMS = Counter(amax=1, amin=1, linalg_vector_norm=1)
NORMALISE_PASSES = Counter(div=1, div_=1)


@pytest.mark.parametrize("shape", [(48, 192), (192, 48), (3, 32, 96)], ids=str)
def test_standard_fp32_needs_no_copy(shape):
    G = torch.randn(*shape)
    kinds = census(G, method="standard", steps=5, compute_dtype=torch.float32)
    assert kinds["products"] == standard_products(5)
    assert kinds["norms"] == NORMALISE_NORMS
    assert kinds["copies"] == Counter()  # the tall transpose rides on the first division
    assert kinds["passes"] == NORMALISE_PASSES


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_a_tall_matrix_is_iterated_in_its_own_layout(method):
    # No transposed copy on the way in (the counts above) and none on the way out: every
    # product that replaces X writes the tall layout, so the result is contiguous and
    # the caller's W -= lr·O reads it in order (a transposed read took 9 ms against
    # 0.9 ms for 2048 × 512 fp32 on one x86 core).
    G = torch.randn(192, 48)
    out = orthogonalize(G, method=method, backend="torch", compute_dtype=torch.float32)
    assert out.is_contiguous()
    kinds = census(G, method=method, compute_dtype=torch.float32)
    assert kinds["norms"] == NORMALISE_NORMS and kinds["passes"] == NORMALISE_PASSES


@pytest.mark.parametrize("restarts", [(2,), (), (1, 3)], ids=str)
@pytest.mark.parametrize("shape", [(32, 128), (128, 32)], ids=str)
def test_gram_fp32_runs_the_products_of_its_definition(shape, restarts):
    G = torch.randn(*shape)
    kinds = census(G, method="gram", steps=5, restarts=restarts, compute_dtype=torch.float32)
    products, q_copies = gram_products(5, restarts)
    assert kinds["products"] == products
    assert kinds["norms"] == NORMALISE_NORMS
    # the only copies are the m × m starts Q = aI + Z of each segment, never X
    assert kinds["copies"] == Counter(clone=q_copies)
    # the identity added to the diagonal of each new Q touches m entries, not a pass
    assert kinds["passes"] == NORMALISE_PASSES


def test_gram_product_walk_matches_the_known_five_step_count():
    # restarts=(2,): R, then Z·Q·RZ·R | Z·Q | restart: QX, R, Z·Q·RZ·R | Z·Q·RZ·R | Z·Q | QX
    products, copies = gram_products(5, (2,))
    assert products == Counter(bmm=4, baddbmm=14) and copies == 2


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_a_dtype_change_costs_one_cast_on_the_way_back(method):
    G = torch.randn(40, 160, dtype=torch.bfloat16)
    kinds = census(G, method=method, compute_dtype=torch.float32)
    # bf16 → fp32 rides on the first division; fp32 → bf16 of the result is one copy
    assert kinds["norms"] == NORMALISE_NORMS
    assert kinds["copies"] - Counter(clone=2) == Counter(_to_copy=1)
    assert kinds["passes"] == NORMALISE_PASSES


def test_a_lower_compute_dtype_casts_on_the_normalising_store():
    G = torch.randn(40, 160)
    kinds = census(G, method="standard", compute_dtype=torch.bfloat16)
    # fp32 → bf16 is the store of X / ‖·‖ (div with out=), bf16 → fp32 the way back
    assert kinds["passes"] == Counter(div=2)
    assert kinds["copies"] == Counter(_to_copy=1)


class _ProductOutputs(TorchDispatchMode):
    """The ``out=`` buffer of every matrix product (None where the product allocates)."""

    def __init__(self) -> None:
        super().__init__()
        self.outs: list[torch.Tensor | None] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in PRODUCTS:
            self.outs.append(kwargs.get("out"))
        return func(*args, **kwargs)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(192, 48), (48, 192), (3, 96, 32)], ids=str)
def test_no_product_writes_a_transposed_output(shape, method, compute):
    # A column-major out= gives the right values, but in bf16 torch's CPU GEMM leaves
    # oneDNN for a reference loop: 19.7 s against 9.5 ms for a 512 × 512 by 512 × 4096
    # product on an AVX-512-BF16 CPU (_layout.left_product). The tall path computes the
    # transposed product into a contiguous buffer instead.
    G = torch.randn(*shape)
    with _ProductOutputs() as seen:
        out = orthogonalize(G, method=method, backend="torch", compute_dtype=compute)
    assert out.is_contiguous()
    assert seen.outs and all(o is None or o.is_contiguous() for o in seen.outs)
