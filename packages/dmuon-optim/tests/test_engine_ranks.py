"""The engine on two real ranks (gloo), without any training framework: gradients
averaged by hand stand in for DDP's."""

import torch
import torch.distributed as dist

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, ModelMismatchError, param_groups


def build(width=12):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 12),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 12),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 3),
    )


def data(rank, world):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    return x[rows], y[rows]


KW = dict(ns_compute_dtype="float32", weight_decay=0.1, lr=0.02)


def run_replicated(rank, world):
    model = build()
    opt = DMuon(param_groups(model), mode="replicated", **KW)
    for _ in range(3):
        torch.nn.functional.mse_loss(model(data(rank, world)[0]), data(rank, world)[1]).backward()
        for p in model.parameters():  # what DDP does
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], sorted(opt.last_step.stepped)


def test_replicated_mode_orthogonalises_each_matrix_once_and_equals_one_process():
    model = build()
    opt = DMuon(param_groups(model), **KW)
    for _ in range(3):
        losses = [
            torch.nn.functional.mse_loss(model(data(r, 2)[0]), data(r, 2)[1]) for r in range(2)
        ]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
    (p0, s0), (p1, s1) = run_on_ranks(run_replicated, 2, timeout=60)
    assert sorted(s0 + s1) == ["0.weight", "2.weight", "4.weight", "6.weight"] and not set(
        s0
    ) & set(s1)
    for mine, theirs, ref in zip(p0, p1, model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        assert (mine - ref.detach()).abs().max() <= 1e-5


def run_mismatch(rank, world):
    try:
        DMuon(param_groups(build(width=12 if rank == 0 else 13)), mode="sign", rule="sign_muon")
    except ModelMismatchError as err:
        return str(err)
    return None


def test_a_different_model_on_one_rank_is_named_on_every_rank():
    for text in run_on_ranks(run_mismatch, 2, timeout=60):
        assert text is not None and "0.weight" in text and "rank 1" in text
