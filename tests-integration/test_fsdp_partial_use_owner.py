"""``fsdp.dedicate`` with a dedicated, bias-free layer run on some ranks only trains as
one process (the promise of partial_use.py and the troubleshooting page).

Before: the owner reductions ran on the mesh's process group, which FSDP2's
reduce-scatter uses too. Rank 0 launched the branch's reduction in backward while rank 1
was already in FSDP2's reduce-scatter of the biases on the same group: gloo matched the
two, and both ranks waited until the process group's own timeout (DMuon's deadline did
not fire). Now DMuon's reductions and broadcasts go over a twin of the group
(:func:`dmuon.comm.process_groups.twin_groups`). Checked against one process stepping
the mean of both ranks' losses, with FSDP2 resharding after forward and without.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 2
STEPS = 2


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a = nn.Linear(8, 8)
            self.branch = nn.Linear(8, 8, bias=False)  # nothing of FSDP2's in it
            self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.a(x)
        if use:
            h = h + self.branch(h)
        return self.b(h)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))


def _train(rank: int, world: int, reshard: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp

    model = Branchy()
    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(model, mesh)
    fully_shard(model, mesh=mesh, ignored_params=ded.params, reshard_after_forward=reshard)
    opt = DMuon(param_groups(model), lr=0.05, distributed=ded, timeout=10)
    for step in range(STEPS):
        model(_batch(step, rank), use=rank == 0).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    out = {}
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = full.detach().clone()
    return out


def _one_process() -> dict[str, torch.Tensor]:
    model = Branchy()
    opt = DMuon(param_groups(model), lr=0.05)
    for step in range(STEPS):
        loss = sum(model(_batch(step, r), use=r == 0).square().mean() / WORLD for r in range(WORLD))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reshard", [False, True])
def test_branch_used_on_one_rank_trains_as_one_process(reshard: bool):
    ranks = run_on_ranks(_train, WORLD, args=(reshard,), timeout=60)
    ref = _one_process()
    for rank, got in enumerate(ranks):
        assert set(got) == set(ref)
        for n, p in got.items():
            torch.testing.assert_close(p, ref[n], atol=1e-5, rtol=1e-5, msg=f"rank {rank}: {n}")
