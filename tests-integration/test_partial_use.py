"""A parameter FSDP2 synchronises, used on some ranks only, is named on every rank
before backward instead of hanging in FSDP2's reduce-scatter (issue: reliability,
round two, defect 2).

The MoE case: rank 1's batch reaches expert 0 only. The experts' matrices are
dedicated (DMuon reduces an absent gradient as zeros), their biases are FSDP2's.
Before: both ranks hung in FSDP2's ``reduce_scatter_single`` (``timeout=`` did not
help; ``ddp.dedicate`` handled the same model). Now: ``PartialUseError`` on every
rank naming ``experts.1.bias``, raised in forward, before any rank enters backward;
and a model whose ranks all use every expert trains as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import PartialUseError
from dmuon.optim import DMuon, param_groups


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 8)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, used: list[int]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(sum(self.experts[i](h) for i in used))


def train(rank: int, world: int, partial: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp

    model = MoE()
    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(model, mesh)
    # one fully_shard unit: the experts' biases are gathered with the root's (an expert
    # wrapped as its own unit would hang earlier, in FSDP2's forward all-gather)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), distributed=ded, timeout=10)
    used = [0] if (partial and rank == 1) else [0, 1]
    for step in range(3):
        try:
            out = model(torch.randn(4, 8), used)
        except PartialUseError as err:
            return {"step": step, "error": str(err), "names": err.names}
        F.mse_loss(out, torch.zeros(4, 2)).backward()
        opt.step()
        opt.zero_grad()
    return {"step": None, "error": None, "names": []}


def test_a_parameter_used_on_some_ranks_only_is_named_on_every_rank_before_backward():
    results = run_on_ranks(train, 2, args=(True,), timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not notice"
        assert r["step"] == 0 and r["names"] == ["experts.1.bias"], r
        assert "some ranks only" in r["error"] and "experts.1.bias" in r["error"], r["error"]


def test_every_expert_used_everywhere_trains_as_before():
    assert [r["error"] for r in run_on_ranks(train, 2, args=(False,), timeout=60)] == [None] * 2
