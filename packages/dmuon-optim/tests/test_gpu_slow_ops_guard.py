"""The operators of one optimizer step of ``musec``, ``sign_muon`` and ``numuon`` (issue 18).

On an H200 these rules were 20–40× slower than Muon because of a few operators:
cuSOLVER's ``eigh`` of an ``m × m`` Gram matrix (``sign_muon``), an fp32
Newton–Schulz on the ``m × n`` matrix (``musec``), a float64 sketch drawn on the
host and copied over, and an SVD of the wide ``l × n`` matrix (``numuon``). These
tests count the ATen operators of one step on the CPU with a ``TorchDispatchMode``
(no timing) and fail if one of them comes back.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dmuon.optim import DMuon
from dmuon.optim.transforms import normalization

M, N = 48, 120  # two matrices of each orientation, batched by shape
MATMULS = {"mm", "bmm", "matmul", "addmm", "baddbmm"}


class OpLog(TorchDispatchMode):
    """Every ATen call: its name and the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))

    def names(self) -> Counter:
        return Counter(name for name, _ in self.calls)

    def shapes_of(self, word: str) -> list[list[tuple[int, ...]]]:
        return [s for name, s in self.calls if word in name]


def one_step(rule: str, **kw) -> OpLog:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in [(M, N)] * 2 + [(N, M)] * 2]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = DMuon([{"params": params}], rule=rule, lr=0.01, **kw)
    with OpLog() as log:
        opt.step()
    return log


pytestmark = pytest.mark.usefixtures("one_thread")


def test_musec_hard_clip_multiplies_by_the_m_by_n_matrix_twice():
    log = one_step("musec")
    assert not [n for n in log.names() if "eigh" in n or "svd" in n]
    big = [s for name, s in log.calls if name in MATMULS and any(M * N in (_n(x),) for x in s)]
    # Per same-shape batch (one wide, one tall → wide): A = M Mᵀ and B^{-1/2}·M. The old
    # construction ran a 12-step Newton–Schulz on the m × n matrix: 2 products per step.
    assert len(big) == 2 * 2, big


def _n(shape: tuple[int, ...]) -> int:
    """Entries of one matrix of a (batch of) matrices."""
    return shape[-1] * shape[-2] if len(shape) >= 2 else 0


def test_sign_muon_has_no_eigh_off_the_cpu(monkeypatch):
    # The device rule sends CPU tensors to LAPACK's eigvalsh (fast there) and every
    # other device to the squaring; run the GPU path here by pretending.
    assert "eigh" in " ".join(one_step("sign_muon").names())
    monkeypatch.setitem(normalization.LAMBDA_MAX_METHOD, "cpu", "squaring")
    log = one_step("sign_muon")
    assert not [n for n in log.names() if "eigh" in n or "svd" in n]


def test_numuon_draws_its_sketch_in_the_work_dtype_and_has_no_wide_svd():
    log = one_step("numuon", rank_fraction=0.25, oversample=4)
    k = 12 + 4  # ⌈0.25·48⌉ + oversample
    assert not [n for n in log.names() if "svd" in n]
    # eigh only of the small l × l Gram matrices
    assert log.shapes_of("eigh") and all(s[0][-2:] == (k, k) for s in log.shapes_of("eigh"))
    # the sketch is drawn directly as fp32 on the matrix's device: no n × l float64 draw
    # converted and copied over each step (88 ms of host RNG per 4 matrices on the H200 run)
    copies = [s for name, s in log.calls if name in ("_to_copy", "copy_") and (N, k) in s]
    assert not copies, copies
