"""Layouts of DTensor matrices that a mode said it takes, stepped like one process.

Each rank gets the same global gradients, laid out as its parameter (``distribute_tensor``
of one tensor), so the distributed run must equal one process stepping the whole
tensors with those gradients (tolerance 1e-5).

* ``single`` mode on an expert stack split along its expert dimension over two mesh
  dimensions (``(Shard(0), Shard(0))`` on ``(efsdp, ep)``; Hugging Face's layout with
  FSDP2 on top): ``placements.supported_by`` and the other modes' refusals name
  ``single``, whose first step failed mixing the DTensor gradient with a plain state.
* ``sharded`` mode on FSDP2 over tensor parallelism where a tp shard has no columns (a
  ``(4, 1)`` matrix over tp 2): the all-to-all dropped the empty items, a KeyError on
  those ranks while their tp peers waited in the Gram all-reduce.
* ``replicated`` mode's ``clip_grad_norm_`` with a tensor-parallel matrix and an expert
  stack on the same mesh dimension: refused as "split over different groups", naming
  the same ranks twice; and a NaN on one rank there, reported as a changed gradient
  (the agreement summed the flags over that ``tp`` dimension twice).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, clip_grad_norm_, param_groups

TOLERANCE = 1e-5
STEPS = 3
OPT = {"lr": 0.02, "weight_decay": 0.01, "ns_compute_dtype": torch.float32}


def _model(shapes) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = nn.Module()
    for i, s in enumerate(shapes):
        setattr(m, f"w{i}", nn.Parameter(torch.randn(*s, generator=g) / s[-1] ** 0.5))
    return m


def _grads(shapes, t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(*s, generator=g) for s in shapes]


def _one_process(shapes, opt_kw, clip=None) -> tuple[list[torch.Tensor], list[float]]:
    """The whole tensors stepped in one process, and (``clip``) torch's norm of the whole
    gradients before each clipped step."""
    m = _model(shapes)
    opt = DMuon(param_groups(m), **opt_kw)
    norms = []
    for t in range(STEPS):
        for p, g in zip(m.parameters(), _grads(shapes, t), strict=True):
            p.grad = g
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)))
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in m.parameters()], norms


def _on_4_ranks(mesh_dims, shapes, specs, opt_kw, clip=None):
    """:func:`run_layout` on 4 ranks, a ``2 × 2`` mesh of ``mesh_dims``."""
    args = ((2, 2), mesh_dims, shapes, specs, opt_kw, clip)
    return run_on_ranks(run_layout, 4, args=args, timeout=120)


def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if s == "R" else Shard(int(s[1:])) for s in spec]


def run_layout(rank, world, mesh_shape, names, shapes, specs, opt_kw, clip=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    m = _model(shapes)
    for i, spec in enumerate(specs):
        full = getattr(m, f"w{i}").detach()
        setattr(m, f"w{i}", nn.Parameter(distribute_tensor(full, mesh, _placements(spec))))
    if opt_kw.get("process_group") == "dp":
        opt_kw = {**opt_kw, "process_group": mesh["dp"].get_group()}
    opt = DMuon(param_groups(m), **opt_kw, timeout=30)
    norms = []
    for t in range(STEPS):
        for p, g, spec in zip(m.parameters(), _grads(shapes, t), specs, strict=True):
            p.grad = distribute_tensor(g, mesh, _placements(spec))
        if clip is not None:
            norms.append(float(clip_grad_norm_(opt, clip)))
        opt.step()
        opt.zero_grad()
    return [p.detach().full_tensor() for p in m.parameters()], norms


def _check(results, expected) -> None:
    for rank, (got, _) in enumerate(results):
        for i, (g, want) in enumerate(zip(got, expected, strict=True)):
            diff = (g - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: w{i} differs by {diff:.2e}"


@pytest.mark.parametrize("experts", [4, 3])
def test_single_mode_steps_experts_split_over_two_mesh_dims(experts):
    shapes = [(experts, 3, 5), (5, 5)]
    specs = [("S0", "S0"), ("R", "R")]
    results = _on_4_ranks(("efsdp", "ep"), shapes, specs, {**OPT, "mode": "single"})
    _check(results, _one_process(shapes, OPT)[0])


def test_sharded_mode_steps_fsdp2_rows_of_a_tp_shard_without_columns():
    shapes = [(4, 1), (4, 3)]  # (4, 1) over tp 2: columns 1 + 0
    specs = [("S0", "S1"), ("S0", "S1")]
    results = _on_4_ranks(("dp", "tp"), shapes, specs, {**OPT, "mode": "sharded"})
    _check(results, _one_process(shapes, OPT)[0])


def test_replicated_clip_with_a_split_matrix_and_experts_on_one_mesh_dim():
    shapes = [(6, 8), (4, 3, 5)]
    specs = [("R", "S0"), ("R", "S0")]  # rows over tp, experts over the same dim
    clip = 1.0
    kw = {**OPT, "mode": "replicated", "process_group": "dp"}
    results = _on_4_ranks(("dp", "tp"), shapes, specs, kw, clip)
    # one process: torch's norm of the whole gradients, then the same clipped steps
    want, want_norms = _one_process(shapes, OPT, clip)
    for rank, (_, norms) in enumerate(results):
        assert norms == pytest.approx(want_norms, rel=1e-5), (rank, norms, want_norms)
    _check(results, want)


def run_nan_on_one_rank(rank, world):
    """The layout above in ``replicated`` mode, ``nonfinite="raise"``: rank 3 alone holds
    a NaN in the expert stack's gradient at the first step. Returns the error's type,
    its ranks and this rank's names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from dmuon.optim import NonFiniteGradientError

    shapes, specs = [(6, 8), (4, 3, 5)], [("R", "S0"), ("R", "S0")]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = _model(shapes)
    for i, spec in enumerate(specs):
        full = getattr(m, f"w{i}").detach()
        setattr(m, f"w{i}", nn.Parameter(distribute_tensor(full, mesh, _placements(spec))))
    kw = {**OPT, "mode": "replicated", "process_group": mesh["dp"].get_group()}
    opt = DMuon(param_groups(m), **kw, nonfinite="raise", timeout=30)
    for p, g, spec in zip(m.parameters(), _grads(shapes, 0), specs, strict=True):
        p.grad = distribute_tensor(g, mesh, _placements(spec))
    if rank == 3:
        m.w1.grad.to_local().view(-1)[0] = float("nan")
    try:
        opt.step()
    except NonFiniteGradientError as err:
        return "NonFiniteGradientError", err.ranks, err.names
    except Exception as err:  # the wrong error: reported, not raised, to show which
        return type(err).__name__, [], [str(err)[:200]]
    return "stepped", [], []


def test_a_nan_on_one_rank_of_a_split_matrix_and_experts_on_one_mesh_dim_is_named():
    """The agreement's flags are summed over each set of ranks once. Before, the ``tp``
    dimension that splits ``w0`` and holds ``w1``'s experts was listed twice, every slot
    counted twice and its bits shifted: the NaN was reported as a changed gradient
    (``GradientChangedError``) on every rank."""
    for rank, (kind, ranks, names) in enumerate(run_on_ranks(run_nan_on_one_rank, 4, timeout=120)):
        assert kind == "NonFiniteGradientError", (rank, kind, names)
        assert ranks == [3], (rank, ranks)
        assert names == (["w1"] if rank == 3 else []), (rank, names)
