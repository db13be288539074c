"""Models, data and training loops shared by the distributed integration tests.

Every test compares a distributed run with a reference computed another way: the
same model trained in one process on the same *global* batch (the mean of the
per-rank losses, which is the global mean because every rank gets the same number
of rows). The functions named ``run_*`` execute inside the ranks of
:func:`dmuon.comm.testing.run_on_ranks`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common.data import BatchSampler
from benchmarks.common.model import GPT, GPTConfig
from dmuon.optim import DMuon, param_groups

# DMUON_TEST_CHECK_EVERY=N: every run that takes the shared options (OPT here, in
# expert_cases.py, tensor_parallel_cases.py and lightning_cases.py) also compares the
# ranks' parameters every N steps (check_every), and a false alarm fails the test that
# made it. Not in CI: a step that checks lands its publications at its end, which would
# hide a misplaced wait in the next forward from the comparisons with one process.
CHECK = (
    {"check_every": int(os.environ["DMUON_TEST_CHECK_EVERY"])}
    if os.environ.get("DMUON_TEST_CHECK_EVERY")
    else {}
)

# fp32 Newton–Schulz: the distributed runs differ from the reference only by the
# order of floating-point sums (the gradient average), ~1e-7 relative.
OPT = dict(
    lr=0.02,
    weight_decay=0.1,
    ns_compute_dtype="float32",
    adamw_lr=3e-3,
    adamw_eps=1e-3,
    **CHECK,
)
STEPS = 5
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
TOLERANCE = 1e-5


# ---------------------------------------------------------------------- models


class ExpertBlock(nn.Module):
    """A residual block with a 3-D expert stack (E, d, d) mixed by a fixed gate."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.Parameter(torch.randn(experts, d, d) / math.sqrt(d))
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gate = torch.softmax(h[..., : self.experts.shape[0]], dim=-1)  # (B, T, E)
        mixed = torch.einsum("bte,edf,btd->btf", gate, self.experts, h)
        return x + mixed + self.down(F.gelu(self.up(h)))


class Mixed(nn.Module):
    """Conv stem, two expert blocks, a linear head: conv, 3-D stacks and 2-D matrices."""

    def __init__(self, seed: int = 0, channels: int = 3, d: int = 8, experts: int = 3) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.stem = nn.Conv1d(channels, d, kernel_size=3, padding=1)
            self.blocks = nn.ModuleList(ExpertBlock(d, experts) for _ in range(2))
            self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x).transpose(1, 2)  # (B, T, d)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


class Conv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (GPT-2's linear layer): ``weight`` stored ``(in, out)``.

    A local copy, so that the tests do not need ``transformers``; ``param_groups`` tells it
    by its class name and ``nf``, as it tells transformers' own.
    """

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) / math.sqrt(nx))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class ToyGPT2Attention(nn.Module):
    """GPT-2's attention in miniature: ``q, k, v = c_attn(x).split(split_size, dim=2)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.split_size = d
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        return self.c_proj(att @ v)


class GPT2Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = ToyGPT2Attention(d)
        self.c_fc = Conv1D(3 * d, d)  # non-square, (in, out) = (d, 3d)
        self.c_out = Conv1D(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h) + self.c_out(F.gelu(self.c_fc(h)))


class Conv1DModel(nn.Module):
    """GPT-2-like blocks of ``Conv1D`` layers on ``Mixed``'s data: transposed weights."""

    def __init__(self, seed: int = 0, channels: int = 3, d: int = 8) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.stem = nn.Linear(channels, d)
            self.blocks = nn.ModuleList(GPT2Block(d) for _ in range(2))
            self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.transpose(1, 2))  # (B, T, d)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


class TanhNet(nn.Module):
    """``blocks`` tanh layers of 8 → 8 and a head 8 → 2 (``extra``: an 8 → 8 residual layer
    between them, which ``forward(x, use_extra=False)`` skips), seeded 0 in a forked RNG so
    that building it leaves the caller's random stream alone.

    The fault tests' model: ``test_timeouts.py`` and ``test_stream_wait_deadline.py`` (3
    blocks), ``test_skip_step.py`` (``blocks=2``), ``test_owner_reliability.py``
    (``extra=True``: a layer one rank may leave unused). ``extra`` is built after the blocks
    and before the head, in that order, so each variant draws the numbers it always drew.
    """

    def __init__(self, blocks: int = 3, extra: bool = False) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))
            self.extra = nn.Linear(8, 8) if extra else None
            self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        if use_extra and self.extra is not None:
            x = x + self.extra(x)
        return self.head(x)


def gelu_mlp() -> nn.Module:
    """8 → 16 → GELU → 4, seeded 0 (the global RNG, as those tests always did).

    The owner-mode model of ``test_changed_gradients.py``, ``test_owner_teardown.py`` and
    ``test_owner_writes.py``.
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def build(name: str) -> nn.Module:
    """A fresh model, the same on every rank."""
    if name == "gpt":
        return GPT(GPTConfig.tiny(seq_len=16, seed=1))
    if name == "gpt_deep":  # four blocks: two per rank of two, same data as "gpt"
        return GPT(GPTConfig.tiny(seq_len=16, seed=1, n_layer=4))
    if name == "mixed":
        return Mixed(seed=1)
    if name == "conv1d":
        return Conv1DModel(seed=1)
    raise ValueError(name)


def batch(name: str, step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[rank·B/N, (rank+1)·B/N)`` of the global batch of ``step`` (``gpt_deep``:
    ``gpt``'s)."""
    if name in ("gpt", "gpt_deep"):
        data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(7))
        sampler = BatchSampler(data.to(torch.uint8), GLOBAL_BATCH, 16, seed=3)
        return sampler.batch(step, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 3, 6, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name in ("gpt", "gpt_deep"):
        logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    return F.mse_loss(model(x), y)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (DTensors gathered), by name."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


# ------------------------------------------------------------------- reference


def reference(
    name: str, world: int, steps: int = STEPS, opt_kw: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """One process, the mean over the ranks' shards of the global batch each step."""
    torch.manual_seed(0)
    model = build(name)
    opt = DMuon(param_groups(model), **(opt_kw or OPT))
    for t in range(steps):
        losses = [loss_of(name, model, *batch(name, t, r, world)) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def mean_loss_reference(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch_of: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    world: int,
) -> dict[str, torch.Tensor]:
    """``reference`` for a model and batches of the test's own: ``steps`` steps in one
    process, each on the mean of the MSE losses of the ``world`` ranks' rows
    ``batch_of(step, rank, world)`` (the global batch's mean: every rank has as many rows).

    Used by ``test_compile.py`` (eager, against the compiled ranks) and
    ``test_fsdp_scalars_only.py`` (against FSDP2 scalars detected as sharded).
    """
    for t in range(steps):
        losses = [F.mse_loss(model(x), y) for x, y in (batch_of(t, r, world) for r in range(world))]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest absolute difference over all parameters, and where."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = max(a, key=lambda k: float((a[k] - b[k]).abs().max()))
    return float((a[worst] - b[worst]).abs().max()), worst


# ------------------------------------------------------------ inside the ranks


def setup(mode: str, name: str, world: int, opt_kw: dict[str, Any] | None = None):
    """Model, module to call forward on, optimizer and dedication (or None), for one mode."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp

    kw = dict(opt_kw or OPT)
    model = build(name)
    forward: nn.Module = model
    if mode in ("owner_fsdp", "owner_fsdp_z3", "sharded", "owner_hsdp"):
        # owner_hsdp: HSDP, 2 replicas of world/2 shards, the ranks laid out column-major
        # (replica 0 is ranks 0, 2, …): an owner slot i·S + j is not its global rank
        mesh = (
            DeviceMesh(
                "cpu",
                torch.arange(world).reshape(world // 2, 2).T,
                mesh_dim_names=("replicate", "shard"),
            )
            if mode == "owner_hsdp" and world > 1
            else init_device_mesh("cpu", (world,))
        )
        ignored = None
        if mode.startswith("owner_fsdp") or mode == "owner_hsdp":
            ded = fsdp.dedicate(model, mesh, reshard_after_forward=mode.endswith("z3"))
            ignored = ded.params
            kw["distributed"] = ded
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    elif mode in ("owner_ddp", "owner_ddp_z3"):
        kw["distributed"] = ddp.dedicate(model, reshard_after_forward=mode.endswith("z3"))
    elif mode == "owner_ddp_sharded_adamw":
        kw["distributed"] = ddp.dedicate(model, scalars="owner")
    elif mode == "replicated":
        forward = DDP(model)
        kw["mode"] = "replicated"
    elif mode == "sign":  # no DDP: each rank's own gradients, the matrices' signs voted
        kw.update(mode="sign", rule="sign_muon")
    elif mode == "single":
        pass
    else:
        raise ValueError(mode)
    opt = DMuon(param_groups(model), **kw)
    return model, forward, opt, kw.get("distributed")


def train_range(
    name: str, forward: nn.Module, opt: Any, rank: int, world: int, start: int, stop: int
) -> None:
    """Steps ``start`` to ``stop - 1`` of ``name`` on this rank's rows: ``run_modes``' loop,
    and the one around a checkpoint of ``test_checkpoint_full.py``,
    ``test_checkpoint_reshard.py`` and ``test_state_dtype_modes.py`` (train, save, train
    on; load, train the rest)."""
    for t in range(start, stop):
        loss_of(name, forward, *batch(name, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def run_modes(
    rank: int,
    world: int,
    name: str,
    modes: list[str],
    steps: int = STEPS,
    opt_kw: dict[str, Any] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``name`` in each mode from the same start; the final parameters per mode."""
    results = {}
    for mode in modes:
        model, forward, opt, ded = setup(mode, name, world, opt_kw)
        train_range(name, forward, opt, rank, world, 0, steps)
        if ded is not None:
            ded.wait()  # the last publications, before reading the weights
        results[mode] = full_params(model)
        dist.barrier()
    return results
