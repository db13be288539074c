"""Random models train in owner, replicated and sharded mode exactly as in one process.

Hypothesis draws the models: a chain of 1–3 linear layers whose widths are drawn
from 1–6 (so ``1×n`` and ``n×1`` matrices, and matrices with fewer rows than ranks,
which FSDP2 shards into empty pieces), with or without biases, a random set of
frozen parameters, and a world size of 1–4. Each model trains two steps in every
mode on the ranks' shards of a global batch, and must end equal (1e-5, fp32
Newton–Schulz: only the order of the gradient sums differs) to one process training
on the mean of the shards' losses.

To stay fast the examples are drawn first (deterministically: the CI profile
derandomises) and then run with one ``run_on_ranks`` call per world size; a failure
names the example, which ``run_example`` replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_cases import full_params, max_diff
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

MODES = ("owner_ddp", "owner_fsdp", "replicated", "sharded")
OPT = dict(lr=0.02, weight_decay=0.1, ns_compute_dtype="float32", adamw_lr=3e-3, adamw_eps=1e-3)
ROWS = 12  # divisible by 1, 2, 3 and 4 ranks
STEPS = 2
TOLERANCE = 1e-5
EXAMPLES = 10


@dataclass(frozen=True)
class Example:
    widths: tuple[int, ...]  # d0 → d1 → … → dL
    bias: tuple[bool, ...]
    frozen: tuple[str, ...]  # names of frozen parameters
    world: int
    seed: int


class Chain(nn.Module):
    def __init__(self, ex: Example) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ex.seed)
            self.layers = nn.ModuleList(
                nn.Linear(a, b, bias=bias)
                for a, b, bias in zip(ex.widths[:-1], ex.widths[1:], ex.bias, strict=True)
            )
        for name, p in self.named_parameters():
            p.requires_grad_(name not in ex.frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x


def data(ex: Example, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * ex.seed + step)
    x, y = (
        torch.randn(ROWS, ex.widths[0], generator=g),
        torch.randn(ROWS, ex.widths[-1], generator=g),
    )
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return x[rows], y[rows]


@st.composite
def examples(draw) -> Example:
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.lists(st.integers(1, 6), min_size=depth + 1, max_size=depth + 1)))
    bias = tuple(draw(st.lists(st.booleans(), min_size=depth, max_size=depth)))
    names = [f"layers.{i}.weight" for i in range(depth)]
    names += [f"layers.{i}.bias" for i in range(depth) if bias[i]]
    frozen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names) - 1))
    # owner mode needs a trainable matrix to dedicate: keep one weight trainable
    keep = draw(st.sampled_from([n for n in names if n.endswith("weight")]))
    frozen = tuple(sorted(set(frozen) - {keep}))
    return Example(widths, bias, frozen, draw(st.integers(1, 4)), draw(st.integers(0, 10**6)))


def reference(ex: Example) -> dict[str, torch.Tensor]:
    model = Chain(ex)
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        losses = [
            F.mse_loss(model(x), y) for x, y in (data(ex, t, r, ex.world) for r in range(ex.world))
        ]
        (sum(losses) / ex.world).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def run_example(rank: int, world: int, ex: Example) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``ex`` in every mode on this rank; the final parameters per mode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp

    out = {}
    for mode in MODES:
        model = Chain(ex)
        forward: nn.Module = model
        kw = dict(OPT)
        if mode == "owner_ddp":
            kw["distributed"] = ded = ddp.dedicate(model)
        elif mode == "owner_fsdp":
            mesh = init_device_mesh("cpu", (world,))
            kw["distributed"] = ded = fsdp.dedicate(model, mesh)
            if any(
                p.requires_grad and not any(p is q for q in ded.params) for p in model.parameters()
            ):
                fully_shard(model, mesh=mesh, ignored_params=set(ded.params))
        elif mode == "replicated":
            forward = DDP(model)
            kw["mode"] = "replicated"
        else:
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = DMuon(param_groups(model), **kw)
        for t in range(STEPS):
            x, y = data(ex, t, rank, world)
            F.mse_loss(forward(x), y).backward()
            opt.step()
            opt.zero_grad()
        if mode.startswith("owner"):
            ded.wait()
        out[mode] = full_params(model)
        dist.barrier()
    return out


def run_many(rank: int, world: int, exs: list[Example]) -> list[dict[str, dict[str, torch.Tensor]]]:
    out = []
    for ex in exs:
        try:
            out.append(run_example(rank, world, ex))
        except Exception as err:
            raise RuntimeError(f"{ex}: {type(err).__name__}: {err}") from err
    return out


def test_random_models_train_like_one_process_in_every_mode():
    drawn: list[Example] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(examples())
    def collect(ex: Example) -> None:
        drawn.append(ex)

    collect()
    worlds = sorted({ex.world for ex in drawn})
    assert len(drawn) >= 5, drawn
    for world in worlds:
        exs = [ex for ex in drawn if ex.world == world]
        results = run_on_ranks(run_many, world, args=(exs,), timeout=300)
        for k, ex in enumerate(exs):
            expected = reference(ex)
            for rank in range(world):
                for mode, params in results[rank][k].items():
                    diff, where = max_diff(params, expected)
                    assert diff <= TOLERANCE, (
                        f"{ex}, {mode}, rank {rank}: {where} off by {diff:.2e}"
                    )
