"""A sparse gradient is refused with one error, naming the parameter, on every way into a
step: ``DMuon.step`` in each mode (checked once, by ``GroupRecord.check``, before the
finiteness guard, the engine, the buckets and the scalar rules, none of which checks
again), and the public functions that step or inspect gradients on their own
(``step_bucket``, ``nonfinite_ranks``). Nothing is stepped."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, build_buckets, get_rule, param_groups, step_bucket
from dmuon.optim.engine import nonfinite_ranks

MESSAGE = r"sparse gradients: parameter {name}.*nn\.Embedding\(sparse=True\)\); use dense"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def _cases(mode: str | None = None) -> list[tuple[str, str | None]]:
    """(the parameter given a sparse gradient, the ``nonfinite=`` policy): a matrix (the
    buckets' former check) and a scalar (the scalar rules'), with the finiteness guard
    (its former check) and without. Sharded mode's matrices are DTensors (see
    :func:`_sharded`): its scalar only."""
    names = ("1.bias",) if mode == "sharded" else ("0.weight", "1.bias")
    return [(n, nf) for n in names for nf in ("raise", None)]


def _sharded(model: nn.Module) -> nn.Module:
    """FSDP2 over every rank, but for the scalar ``1.bias``: its gradient stays a plain
    tensor, which can be made sparse (a DTensor cannot hold a sparse local tensor:
    ``DTensor.from_local`` and ``to_sparse`` raise ``NotImplementedError``, torch 2.13)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return fully_shard(model, mesh=mesh, ignored_params={model[1].bias})


def _make_sparse(model: nn.Module, name: str) -> None:
    """Give parameter ``name`` a sparse gradient (its own, else ones)."""
    p = dict(model.named_parameters())[name]
    p.grad = (p.grad if p.grad is not None else torch.ones_like(p)).to_sparse()


def _step_refused(opt: DMuon, model: nn.Module) -> tuple[str | None, bool]:
    """``opt.step()``: the error's text (``None``: it stepped) and whether every parameter
    of ``model`` was left untouched."""
    before = [q.detach().clone() for q in model.parameters()]
    try:
        opt.step()
        error = None
    except RuntimeError as err:
        error = str(err)
    untouched = all(torch.equal(a, q) for a, q in zip(before, model.parameters(), strict=True))
    return error, untouched


def _refusals(mode: str | None, rule: str = "muon") -> list[str]:
    """Each case of :func:`_cases` on a fresh optimizer: the error's text, the parameters
    left untouched."""
    texts = []
    for name, nonfinite in _cases(mode):
        model = _sharded(_model()) if mode == "sharded" else _model()
        kwargs = {} if mode is None else {"mode": mode}
        opt = DMuon(param_groups(model), rule=rule, nonfinite=nonfinite, **kwargs)
        model(torch.randn(3, 6)).sum().backward()
        _make_sparse(model, name)
        text, untouched = _step_refused(opt, model)
        assert text is not None and untouched and opt.steps_taken == 0, text
        texts.append(text)
    return texts


def _check(texts: list[str], mode: str | None = None) -> None:
    for text, (name, _) in zip(texts, _cases(mode), strict=True):
        assert text.startswith("DMuon does not support sparse gradients"), text
        assert re.search(MESSAGE.format(name=repr(name)), text), text


def test_single_mode_names_the_parameter_with_and_without_the_guard():
    _check(_refusals(None))


def test_an_embedding_with_sparse_gradients_is_named():
    model = nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "out": nn.Linear(4, 4)})
    opt = DMuon(param_groups(model))
    model["out"](model["emb"](torch.tensor([1, 2, 3]))).sum().backward()
    with pytest.raises(RuntimeError, match=MESSAGE.format(name="'emb.weight'")):
        opt.step()


def _on_rank(rank: int, world: int, mode: str, rule: str) -> list[str]:
    return _refusals(mode, rule)


@pytest.mark.parametrize(
    ("mode", "rule"),
    [("replicated", "muon"), ("sharded", "muon"), ("sign", "sign_muon")],
)
def test_each_distributed_mode_names_the_parameter_on_every_rank(mode, rule):
    # every rank holds the same sparse gradient and raises before any collective
    for texts in run_on_ranks(_on_rank, 2, args=(mode, rule), timeout=120):
        _check(texts, mode)


def test_step_bucket_called_on_its_own_names_the_parameter():
    model = _model()
    group = DMuon(param_groups(model)).param_groups[0]  # the matrix group, named
    buckets, state = build_buckets(group, get_rule("muon"), lambda p: {}, str)
    model[0].weight.grad = torch.randn(8, 6).to_sparse()
    before = model[0].weight.detach().clone()
    (bucket,) = [b for b in buckets if any(e.param is model[0].weight for e in b.entries)]
    with pytest.raises(RuntimeError, match=MESSAGE.format(name="'0.weight'")):
        step_bucket(bucket, group, get_rule("muon"), state)
    assert torch.equal(model[0].weight.detach(), before)


def test_nonfinite_ranks_names_a_sparse_gradient():
    model = _model()
    opt = DMuon(param_groups(model))
    model[2].weight.grad = torch.randn(4, 8).to_sparse()
    with pytest.raises(RuntimeError, match=MESSAGE.format(name="'2.weight'")):
        nonfinite_ranks(opt.engine)


def _one_rank_sparse(rank: int, world: int, mode: str, rule: str) -> dict[str, object]:
    """Rank 1 alone makes ``1.bias``'s gradient sparse; the optimizer's deadline (60 s) is
    longer than the test's, so a rank left waiting fails the test."""
    model = _model()
    opt = DMuon(param_groups(model), rule=rule, mode=mode, timeout=60)
    model(torch.randn(3, 6)).sum().backward()
    if rank == 1:
        _make_sparse(model, "1.bias")
    error, untouched = _step_refused(opt, model)
    return {"error": error, "untouched": untouched, "steps": opt.steps_taken}


@pytest.mark.parametrize(("mode", "rule"), [("replicated", "muon"), ("sign", "sign_muon")])
def test_one_ranks_sparse_gradient_is_refused_on_every_rank(mode, rule):
    # before: rank 1 raised in DMuon.step before any collective, and rank 0 waited in the
    # step's agreement until the deadline (60 s), past this test's timeout
    out = run_on_ranks(_one_rank_sparse, 2, args=(mode, rule), timeout=40)
    for r in out:
        assert r["error"] is not None and "sparse gradients" in r["error"], r["error"]
        assert "rank(s) [1]" in r["error"], r["error"]
        assert r["untouched"] and r["steps"] == 0
    assert re.search(MESSAGE.format(name="'1.bias'"), out[1]["error"]), out[1]["error"]
