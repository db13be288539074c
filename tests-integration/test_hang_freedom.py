"""No rank hangs, and the results stay right, when ranks or parameters are irregular.

* a parameter with a gradient on one rank only (a block skipped on rank 1), a
  parameter no rank uses, a frozen parameter, a tied matrix, and layers registered
  in one order but run in another: owner mode (FSDP2 and DDP replacement) and
  replicated mode equal the single-process reference on the same global batch;
* a rank whose model differs (a shape, an extra or a missing parameter): every rank
  raises ``ModelMismatchError`` naming the parameter, before any other collective,
  well within the timeout.
"""

import pytest
import torch
import torch.nn.functional as F
from distributed_cases import OPT, TOLERANCE, full_params, max_diff
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, ModelMismatchError, param_groups

STEPS = 3
ROWS = 12


class Irregular(nn.Module):
    """Blocks registered 0, 1, 2 but run 2, 0, 1; block 1 skipped on demand; a frozen
    layer; a layer never used; one matrix shared by two modules."""

    def __init__(self, d: int = 6, variant: str | None = None) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            widths = {"shape": (d, d + 1)} if variant == "shape" else {}
            self.blocks = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(3))
            if variant == "shape":
                self.blocks[1] = nn.Linear(*widths["shape"], bias=False)
            self.frozen = nn.Linear(d, d, bias=False)
            self.frozen.weight.requires_grad_(False)
            self.unused = nn.Linear(d, d, bias=False)
            self.a = nn.Linear(d, d, bias=False)
            self.b = nn.Linear(d, d, bias=False)
            self.b.weight = self.a.weight  # tied: one parameter, used twice
            self.head = nn.Linear(d, 2)
            if variant == "extra":
                self.extra = nn.Linear(d, d, bias=False)
            if variant == "missing":
                del self.unused

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = x
        for i in (2, 0, 1):
            if skip and i == 1:
                continue
            h = torch.tanh(self.blocks[i](h))
        h = self.frozen(h)
        h = self.b(torch.tanh(self.a(h)))
        return self.head(h)


def data(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(50 + step)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 2, generator=g)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return x[rows], y[rows]


def reference(world):
    model = Irregular()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        losses = [
            F.mse_loss(model(data(t, r, world)[0], skip=r == 1), data(t, r, world)[1])
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def run_irregular(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp

    out = {}
    for mode in ("owner_fsdp", "owner_ddp", "replicated"):
        model = Irregular()
        forward = model
        kw = dict(OPT)
        if mode == "owner_fsdp":
            mesh = init_device_mesh("cpu", (world,))
            kw["distributed"] = ded = fsdp.dedicate(model, mesh)
            fully_shard(model, mesh=mesh, ignored_params=ded.params)
        elif mode == "owner_ddp":
            kw["distributed"] = ded = ddp.dedicate(model)
        else:
            forward = DDP(model, find_unused_parameters=True)
            kw["mode"] = "replicated"
        opt = DMuon(param_groups(model), **kw)
        for t in range(STEPS):
            x, y = data(t, rank, world)
            F.mse_loss(forward(x, skip=rank == 1), y).backward()
            opt.step()
            opt.zero_grad()
        if mode != "replicated":
            ded.wait()
        out[mode] = full_params(model)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_unused_frozen_tied_and_reordered_parameters_train_like_one_process(world):
    expected = reference(world)
    start = full_params(Irregular())
    assert torch.equal(expected["unused.weight"], start["unused.weight"])  # never stepped
    assert torch.equal(expected["frozen.weight"], start["frozen.weight"])
    results = run_on_ranks(run_irregular, world, timeout=120)
    for rank in range(world):
        for mode, params in results[rank].items():
            diff, where = max_diff(params, expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"


def run_mismatch(rank, world):
    from dmuon.integrations import ddp

    messages = {}
    for variant in ("shape", "extra", "missing"):
        for how in ("dedicate", "replicated"):
            model = Irregular(variant=variant if rank == 1 else None)
            try:
                if how == "dedicate":
                    ddp.dedicate(model)
                else:
                    DMuon(param_groups(model), mode="replicated")
                messages[variant, how] = None
            except ModelMismatchError as err:
                messages[variant, how] = str(err)
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_a_mismatched_model_on_one_rank_fails_on_every_rank_naming_the_parameter(world):
    results = run_on_ranks(run_mismatch, world, timeout=60)
    named = {"shape": "blocks.1.weight", "extra": "extra.weight", "missing": "unused.weight"}
    for rank, messages in enumerate(results):
        for (variant, how), text in messages.items():
            assert text is not None, f"rank {rank} did not notice the {variant} mismatch ({how})"
            assert named[variant] in text, f"rank {rank}, {variant} ({how}): {text}"
            assert "rank 1" in text
