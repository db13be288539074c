"""param_groups(model): what the ``matrix=`` predicate overrides and what it does not, how a
transposed convolution's weight is seen as a matrix, and which names mark an embedding.

* A predicate chooses the side (matrix rule or AdamW), never how the rule sees the matrix:
  a forced parameter keeps the ``split_sizes``/``num_heads`` its name matches and the q|k|v
  split of ``nn.MultiheadAttention`` and GPT-2's ``c_attn``.
* ``nn.ConvTranspose`` weights are stored ``(in, out, *kernel)``; DMuon orthogonalises
  them as ``(out, in·kernel)``, rows the output channels as for every other weight
  (docs/algorithms/index.md, "Shapes"), checked against the update restated from a float64
  SVD, and against the convolution a stride-1 transposed convolution equals.
* "Named like an embedding" is decided on the words of the parameter's own name and its
  module's, not on any substring of the dotted path (``router.member_table``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups
from dmuon.optim.assignment import embedding_like

pytestmark = pytest.mark.usefixtures("one_thread")

STRUCTURE = ("flatten", "transposed", "split_sizes", "num_heads")
E = 16


class Conv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (``transformers.pytorch_utils``): weight stored ``(in, out)``."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)


class GPT2Attention(nn.Module):
    """The layout of transformers' ``GPT2Attention``: ``c_attn`` of width 3E, ``split_size`` E."""

    def __init__(self):
        super().__init__()
        self.split_size = E
        self.c_attn = Conv1D(3 * E, E)


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, 4, bias=False)
        self.emb_qkv = nn.Linear(E, 3 * E, bias=False)  # fused, and named like an embedding
        self.attn = GPT2Attention()


FUSED = ("mha.in_proj_weight", "emb_qkv.weight", "attn.c_attn.weight")


def structure(groups) -> dict[str, dict]:
    """Each parameter's group keys that say how the rule sees it."""
    return {
        n: {k: g[k] for k in STRUCTURE if g.get(k) not in (None, False)}
        for g in groups
        for n in g["param_names"]
    }


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"split_sizes": {r"emb_qkv": (E, E, E)}},
            {
                "mha.in_proj_weight": {"split_sizes": (E, E, E)},
                "emb_qkv.weight": {"split_sizes": (E, E, E)},
                "attn.c_attn.weight": {"transposed": True, "split_sizes": (E, E, E)},
            },
        ),
        (
            {"num_heads": {r"emb_qkv|in_proj|c_attn": 4}},
            {
                "mha.in_proj_weight": {"split_sizes": (E, E, E), "num_heads": 4},
                "emb_qkv.weight": {"num_heads": 4},
                "attn.c_attn.weight": {
                    "transposed": True,
                    "split_sizes": (E, E, E),
                    "num_heads": 4,
                },
            },
        ),
    ],
    ids=["split_sizes", "num_heads"],
)
def test_a_forced_matrix_is_cut_as_it_would_be_unforced(options, expected):
    torch.manual_seed(0)
    unforced = structure(param_groups(Fused(), **options))
    forced_groups = param_groups(Fused(), matrix=lambda n, p: n in FUSED, **options)
    forced = structure(forced_groups)
    for name in FUSED:
        assert forced[name] == unforced[name] == expected[name], name
    reasons = {a.name: a.reason for a in forced_groups.assignments}
    assert all(reasons[n].startswith("matrix predicate") for n in FUSED), reasons


# ---- ConvTranspose: rows are the output channels ------------------------------------------

# what DMuon's fp32 arithmetic leaves against the float64 restatement, with the converged
# Newton–Schulz iteration (test_rules_papers.py: 2e-6 from the SVD's polar factor): 2e-8 to
# 7e-8 here after four steps; the stored (in, out·kernel) flattening is ~1e-2 off
TOL = 1e-5
CONVERGED_NS = dict(
    ns_method="gram", ns_coefficients="polar_express_raw", ns_steps=10, ns_compute_dtype="float32"
)
LR, BETA, STEPS = 0.05, 0.9, 4


def polar(X: torch.Tensor) -> torch.Tensor:
    """The exact polar factor ``U Vᵀ`` of a float64 SVD."""
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh


class Ups(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.ConvTranspose2d(4, 6, 3, bias=False)  # (4, 6, 3, 3) → (6, 36)
        self.b = nn.ConvTranspose2d(4, 6, 3, bias=False)  # same shape: one batched bucket
        self.c = nn.ConvTranspose1d(5, 3, 2, bias=False)  # (5, 3, 2) → (3, 10)
        self.g = nn.ConvTranspose1d(4, 6, 3, groups=2, bias=False)  # (4, 3, 3): as stored


def as_matrix(name: str, w: torch.Tensor) -> torch.Tensor:
    """The documented matrix of each weight: ``(out, in·kernel)``, and for the grouped one
    ``(in, out/groups·kernel)`` as stored."""
    if name == "g.weight":
        return w.reshape(w.shape[0], -1)
    return w.transpose(0, 1).reshape(w.shape[1], -1)


def from_matrix(name: str, X: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if name == "g.weight":
        return X.reshape(shape)
    return X.reshape(shape[1], shape[0], *shape[2:]).transpose(0, 1)


def test_conv_transpose_weights_step_as_out_by_in_kernel_matrices():
    """Muon (``nesterov=False``, ``adjust_lr="spectral"``: ``√(m/n)`` depends on which side
    is the rows) against its restatement: sum-form momentum, the polar factor of the
    documented ``(out, in·kernel)`` matrix by a float64 SVD, scaled by ``√(out/(in·k))``."""
    torch.manual_seed(0)
    model = Ups()
    groups = param_groups(model)
    opt = DMuon(
        groups, rule="muon", lr=LR, momentum=BETA, nesterov=False, weight_decay=0.0,
        adjust_lr="spectral", **CONVERGED_NS,
    )  # fmt: skip
    named = dict(model.named_parameters())
    ref = {n: p.detach().double().clone() for n, p in named.items()}
    mom = {n: torch.zeros_like(w) for n, w in ref.items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for n, p in named.items():
            p.grad = torch.randn(p.shape, generator=gen)
            mom[n] = BETA * mom[n] + p.grad.double()
            X = as_matrix(n, mom[n])
            scale = math.sqrt(X.shape[0] / X.shape[1])
            ref[n] -= LR * scale * from_matrix(n, polar(X), p.shape)
        opt.step()
    for n, p in named.items():
        diff = float((p.detach().double() - ref[n]).abs().max())
        assert diff < TOL, f"{n}: {diff:.2e} from the (out, in·kernel) restatement"
        state = opt.state[p]["momentum_buffer"]
        assert state.shape == p.shape and torch.allclose(state.double(), mom[n], atol=1e-5), n
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert [bool(by_name[n].get("transposed")) for n in ("a.weight", "c.weight", "g.weight")] == [
        True,
        True,
        False,
    ]


def test_a_stride_1_conv_transpose_trains_as_the_convolution_it_equals():
    """``ConvTranspose2d(in, out, k, padding=p)`` equals ``Conv2d(in, out, k,
    padding=k-1-p)`` with weight ``w.transpose(0, 1)`` flipped over the kernel. NorMuon
    (row statistics, so the rows must be the output channels in both) trains the two to the
    same weights: the flip only permutes the columns of ``(out, in·kernel)``."""
    up, conv = _equivalent_pair()
    opts = [DMuon(param_groups(m), rule="normuon", lr=0.05, **CONVERGED_NS) for m in (up, conv)]
    gen = torch.Generator().manual_seed(2)
    start = conv.weight.detach().clone()
    for _ in range(STEPS):
        x, y = torch.randn(2, 3, 6, 6, generator=gen), torch.randn(2, 5, 6, 6, generator=gen)
        for m, opt in zip((up, conv), opts, strict=True):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    assert float((conv.weight.detach() - start).abs().max()) > 1e-2  # it trained
    as_conv = up.weight.detach().transpose(0, 1).flip(2, 3)
    diff = float((as_conv - conv.weight.detach()).abs().max())
    # two backward passes that sum in different orders: fp32 rounding, 1.1e-7 here
    assert diff < 1e-5, f"the transposed convolution trained {diff:.2e} away from the conv"


def _equivalent_pair() -> tuple[nn.Module, nn.Module]:
    """A stride-1 ``ConvTranspose2d`` and the ``Conv2d`` it equals."""
    torch.manual_seed(0)
    up = nn.ConvTranspose2d(3, 5, 3, padding=1, bias=False)
    conv = nn.Conv2d(3, 5, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(up.weight.transpose(0, 1).flip(2, 3))
    return up, conv


def _train_pair_sharded(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both of :func:`_equivalent_pair` under FSDP2 (``sharded`` mode), this rank's half of
    each global batch; their whole weights at the end."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    models = _equivalent_pair()
    opts = []
    for m in models:
        fully_shard(m, mesh=mesh)
        opts.append(DMuon(param_groups(m), rule="normuon", lr=0.05, **CONVERGED_NS))
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(4, 3, 6, 6, generator=gen), torch.randn(4, 5, 6, 6, generator=gen)
        rows = slice(2 * rank, 2 * rank + 2)
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            F.mse_loss(m(x[rows]), y[rows]).backward()
            opt.step()
    up, conv = (m.weight.full_tensor().detach() for m in models)  # type: ignore[attr-defined]
    return up, conv


def test_sharded_mode_trains_a_conv_transpose_as_the_convolution_it_equals():
    """``sharded`` mode gathers each gradient as ``(dim 0, rest)`` (the planned shape);
    the owner must still see the weight as ``(out, in·kernel)``. Two real ranks, gloo."""
    for up, conv in run_on_ranks(_train_pair_sharded, 2, timeout=120):
        diff = float((up.transpose(0, 1).flip(2, 3) - conv).abs().max())
        assert diff < 1e-5, f"sharded: the transposed convolution is {diff:.2e} from the conv"


# ---- names like an embedding --------------------------------------------------------------


class Holder(nn.Module):
    """A module that holds a 2-D parameter directly (not an ``nn.Linear``/``nn.Embedding``)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(12, 8))


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Module()
        self.router.member_table = nn.Parameter(torch.randn(8, 8))  # "emb" inside a word
        self.router.remember = Holder()
        self.embed_tokens = Holder()
        self.tok_embeddings = Holder()
        self.wte = Holder()
        self.embedding = Holder()
        self.pos_emb = nn.Parameter(torch.randn(4, 8))
        self.proj = nn.Linear(8, 8, bias=False)


def test_embedding_names_are_words_not_substrings_of_the_path():
    groups = param_groups(Named())
    side = {a.name: a.group for a in groups.assignments}
    hidden = ("router.member_table", "router.remember.weight", "proj.weight")
    embeddings = (
        "embed_tokens.weight",
        "tok_embeddings.weight",
        "wte.weight",
        "embedding.weight",
        "pos_emb",
    )
    assert {n: side[n] for n in hidden} == dict.fromkeys(hidden, "matrix")
    assert {n: side[n] for n in embeddings} == dict.fromkeys(
        embeddings, "scalar: embeddings and head"
    )


def test_the_embedding_warning_reads_the_same_words():
    assert not embedding_like("router.member_table.weight")
    assert not embedding_like("router.remember.weight")
    assert all(
        embedding_like(f"{m}.weight") for m in ("embed_tokens", "tok_embeddings", "wte", "emb")
    )
