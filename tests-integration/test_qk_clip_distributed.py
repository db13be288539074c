"""QK-clip on 2 ranks equals QK-clip in one process on the same global batch.

A two-block model with causal ``nn.MultiheadAttention`` whose q/k weights start
large (every head's logits far over τ, so the clip scales every step) trains 4
steps with ``QKClip.step()`` after each ``optimizer.step()`` in each layout where
the weights live differently:

* ``replicated``: stock DDP, DMuon ``replicated`` mode (plain weights, scaled alike
  on every rank after the all-reduce MAX);
* ``sharded``: stock FSDP2 (``fully_shard``), DMuon ``sharded`` mode: DTensor
  ``Shard(0)`` weights, each rank scales its own rows — ``in_proj_weight``'s 24 rows
  split 12/12 cut through the key rows, so the row factors must follow the shard;
* ``adamw_fsdp``: the same FSDP2 layout with ``torch.optim.AdamW``;
* ``owner_ddp``: DMuon owner mode (``ddp.dedicate``): the clip waits for the
  owners' publications, then every rank scales its copy;
* ``owner_fsdp``: ``fsdp.dedicate`` (matrices owned, biases FSDP2 DTensors).

``scale_rows_`` itself is checked on DTensors of 5 rows (uneven shards, 3 + 2) placed
``Shard(0)``, ``Shard(1)``, ``Replicate()`` and ``(Replicate(), Shard(0))`` (HSDP), and
on their transposes with ``dim=1`` (5 columns: a weight stored ``(in, out)``).

In ``adamw_fsdp`` and ``owner_fsdp`` the ``QKClip`` is made before ``fully_shard``
replaces the parameters: it must scale the ones the modules hold at the step.

A tiny Hugging Face Llama (grouped-query attention, q/k biases, ``sdpa``) and a tiny
GPT-2 (the fused ``c_attn`` stored ``(in, out)``, its q and k *columns* scaled; split
q|k|v by ``param_groups``, so in owner mode its three blocks may have different
owners) do the same under FSDP2 (``sharded``, whose ``Shard(0)`` of ``c_attn`` cuts
its input rows) and ``ddp.dedicate`` (owner mode).

The reference trains the same model in this process on the mean of the ranks'
losses, calling the same ``QKClip`` (its hooks see every rank's rows, so its
``S_max`` is the global one). Tolerance 1e-5, as the other mode tests: the runs differ
only in the order of the gradient sums. The test has teeth: without the clip the
weights end far from the clipped reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_cases import full_params
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, QKClip, param_groups

TAU = 4.0
STEPS = 4
GLOBAL_BATCH = 8
TOLERANCE = 1e-5
OPT = dict(lr=0.02, weight_decay=0.1, ns_compute_dtype="float32", adamw_lr=3e-3, adamw_eps=1e-3)
MODES = ["replicated", "sharded", "adamw_fsdp", "owner_ddp", "owner_fsdp"]
EARLY = ("adamw_fsdp", "owner_fsdp")  # QKClip made before the model is sharded/dedicated


class Block(nn.Module):
    def __init__(self, E: int = 8, H: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.fc = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
        a, _ = self.attn(x, x, x, attn_mask=causal, need_weights=False)
        return x + self.fc(a)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            for b in self.blocks:
                b.attn.in_proj_weight[:16].mul_(8.0)  # q and k rows: logits blow up
                b.attn.in_proj_bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=1))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 5, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def make_optimizer(layout: str, model: nn.Module, **kw):
    if layout.startswith("adamw"):
        return torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-3)
    return DMuon(param_groups(model), **{**OPT, **kw})


def reference(mode: str, world: int, clip: bool = True) -> dict[str, torch.Tensor]:
    model = Net()
    opt = make_optimizer(mode, model)
    qk = QKClip(model, tau=TAU) if clip else None
    for t in range(STEPS):
        losses = [F.mse_loss(model(x), y) for x, y in (batch(t, r, world) for r in range(world))]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
        if qk is not None:
            qk.step()
    return full_params(model)


def run_mode(mode: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp

    model = Net()
    forward: nn.Module = model
    kw = {}
    ded = None
    # made before fully_shard/dedicate replace or re-alias the parameters: the clip must
    # scale the parameters the modules hold at the step, not the ones they held here
    early = QKClip(model, tau=TAU) if mode in EARLY else None
    if mode in ("sharded", "adamw_fsdp", "owner_fsdp"):
        mesh = init_device_mesh("cpu", (world,))
        ignored = None
        if mode == "owner_fsdp":
            ded = fsdp.dedicate(model, mesh)
            ignored = ded.params
            kw["distributed"] = ded
        for b in model.blocks:
            fully_shard(b, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    elif mode == "owner_ddp":
        ded = ddp.dedicate(model)
        kw["distributed"] = ded
    elif mode == "replicated":
        forward = DDP(model)
        kw["mode"] = "replicated"
    opt = make_optimizer(mode, model, **kw)
    qk = early or QKClip(model, tau=TAU)
    clipped = 0
    waited: list[str] = []
    for t in range(STEPS):
        x, y = batch(t, rank, world)
        F.mse_loss(forward(x), y).backward()
        opt.step()
        opt.zero_grad()
        pending = [] if ded is None else ded.exchange.publication.pending_publications()
        report = qk.step()
        clipped += report.clipped_heads
        if pending and report.clipped_heads:
            # the owners' broadcasts of this step landed before any rank scaled its copy
            # (scaling a weight still in flight would race the broadcast)
            assert ded.exchange.publication.pending_publications() == [], mode
            waited.append(mode)
    if ded is not None:
        ded.wait()
    assert clipped > 0, f"{mode}: the clip never scaled a head"
    assert mode.startswith("owner") == bool(waited), f"{mode}: publications in flight {waited}"
    return full_params(model)


def run_placements(rank: int, world: int) -> dict[str, torch.Tensor]:
    """``scale_rows_`` on DTensors placed every way it accepts, gathered whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dmuon.optim.row_scaling import scale_rows_

    w = torch.arange(15.0).reshape(5, 3) + 1  # 5 rows over 2 ranks: 3 + 2
    f = torch.tensor([0.5, 1.0, 0.25, 2.0, 0.125], dtype=torch.float64)
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    cases = {
        "shard0": (mesh, [Shard(0)]),
        "shard1": (mesh, [Shard(1)]),
        "replicate": (mesh, [Replicate()]),
        "hsdp": (mesh2, [Replicate(), Shard(0)]),
    }
    out = {}
    for name, (m, placements) in cases.items():
        d = distribute_tensor(w.clone(), m, placements)
        scale_rows_(d, f)
        out[name] = d.full_tensor()
        # the same values stored (in, out), as GPT-2's Conv1D: the factors scale columns
        d = distribute_tensor(w.T.contiguous(), m, placements)
        scale_rows_(d, f, dim=1)
        out[f"columns_{name}"] = d.full_tensor().T
    bias = distribute_tensor(w[:, 0].clone(), mesh, [Shard(0)])
    scale_rows_(bias, f)
    out["bias"] = bias.full_tensor()
    return out


def run_all(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {"placements": run_placements(rank, world)}
    for mode in MODES:
        out[mode] = run_mode(mode, rank, world)
        dist.barrier()
    from dmuon.integrations import ddp

    out["z3_error"] = "not refused"  # type: ignore[assignment]
    try:  # the ZeRO-3-like owner mode keeps weights on owners only: refused
        model = Net()
        ddp.dedicate(model, reshard_after_forward=True)
        QKClip(model, tau=TAU)
    except ValueError as err:
        out["z3_error"] = str(err)  # type: ignore[assignment]
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst = max(a, key=lambda k: float((a[k] - b[k]).abs().max()))
    return float((a[worst] - b[worst]).abs().max()), worst


@pytest.mark.parametrize("world", [2])
def test_every_layout_clips_as_one_process(world):
    expected = {m: reference(m, world) for m in ("muon", "adamw")}
    unclipped = reference("muon", world, clip=False)
    teeth, where = max_diff(expected["muon"], unclipped)
    assert teeth > 1e-2, f"the clip barely changed the run ({where}): the test would prove nothing"
    results = run_on_ranks(run_all, world, timeout=180)
    for mode in MODES:
        ref = expected["adamw" if mode.startswith("adamw") else "muon"]
        for rank in range(world):
            diff, where = max_diff(results[rank][mode], ref)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"
            same, where = max_diff(results[rank][mode], results[0][mode])
            assert same == 0.0, f"{mode}: rank {rank} and rank 0 differ at {where}"
    for rank in range(world):
        assert "reshard_after_forward=True" in results[rank]["z3_error"]
        w = torch.arange(15.0).reshape(5, 3) + 1
        f = torch.tensor([0.5, 1.0, 0.25, 2.0, 0.125])
        for name, got in results[rank]["placements"].items():  # uneven rows: 3 + 2
            want = w[:, 0] * f if name == "bias" else w * f[:, None]
            assert torch.equal(got, want), f"{name}: {got} != {want}"


# ------------------------------------ Hugging Face Llama (GQA, biases) and GPT-2 (Conv1D)

HF_MODES = ["hf_sharded", "hf_owner_ddp"]


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: a key head per 2 query heads
        attention_bias=True,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(60.0)
                proj.bias.normal_()
    return model


def tiny_gpt2() -> nn.Module:
    """GPT-2: fused ``c_attn`` stored (in, out), split q|k|v by ``param_groups``; no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :32].mul_(60.0)  # the q and k columns
            block.attn.c_attn.bias.normal_()
    return model


HF_MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def blocks(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def tokens(step: int, rank: int, world: int) -> torch.Tensor:
    ids = torch.randint(0, 32, (GLOBAL_BATCH, 6), generator=torch.Generator().manual_seed(step))
    return ids[rank * GLOBAL_BATCH // world : (rank + 1) * GLOBAL_BATCH // world]


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def hf_reference(kind: str, world: int, clip: bool = True) -> dict[str, torch.Tensor]:
    model = HF_MODELS[kind]()
    opt = DMuon(param_groups(model), **OPT)
    qk = QKClip(model, tau=TAU) if clip else None
    for t in range(STEPS):
        (sum(hf_loss(model, tokens(t, r, world)) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
        if qk is not None:
            qk.step()
    return full_params(model)


def run_hf(rank: int, world: int, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import ddp

    out = {}
    for mode in HF_MODES:
        model = HF_MODELS[kind]()
        kw = {}
        ded = None
        if mode == "hf_sharded":
            mesh = init_device_mesh("cpu", (world,))
            for layer in blocks(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            ded = ddp.dedicate(model)
            kw["distributed"] = ded
        opt = DMuon(param_groups(model), **{**OPT, **kw})
        qk = QKClip(model, tau=TAU)
        clipped = 0
        for t in range(STEPS):
            hf_loss(model, tokens(t, rank, world)).backward()
            opt.step()
            opt.zero_grad()
            clipped += qk.step().clipped_heads
        if ded is not None:
            ded.wait()
        assert clipped > 0, f"{mode}: the clip never scaled a head"
        out[mode] = full_params(model)
        dist.barrier()
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_attention_clips_as_one_process(kind):
    pytest.importorskip("transformers")
    world = 2
    expected = hf_reference(kind, world)
    teeth, where = max_diff(expected, hf_reference(kind, world, clip=False))
    assert teeth > 1e-2, f"the clip barely changed the run ({where}): the test would prove nothing"
    results = run_on_ranks(run_hf, world, args=(kind,), timeout=180)
    for mode in HF_MODES:
        for rank in range(world):
            diff, where = max_diff(results[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"


def run_nan_on_one_rank(rank: int, world: int) -> tuple[str | None, bool]:
    """Rank 1 alone sees a NaN token; rank 0's logits are finite (and far over τ)."""
    model = Net()
    qk = QKClip(model, tau=TAU)
    before = full_params(model)
    x, _ = batch(0, rank, world)
    if rank == 1:
        x[0, 2, 0] = float("nan")
    model(x)
    try:
        qk.step()
        message = None
    except RuntimeError as err:
        message = str(err)
    unchanged = all(torch.equal(p, before[n]) for n, p in full_params(model).items())
    return message, unchanged


def test_a_nan_logit_on_one_rank_is_refused_on_every_rank_and_nothing_is_scaled():
    """gloo's MAX all-reduce drops rank 1's NaN for rank 0's number, which would let every
    rank clip by rank 0's maxima as if nothing had happened."""
    results = run_on_ranks(run_nan_on_one_rank, 2, timeout=60)
    for rank, (message, unchanged) in enumerate(results):
        assert message is not None, f"rank {rank}: a NaN logit on rank 1 was not refused"
        assert "non-finite maximum logit" in message and "'blocks.0.attn'" in message, message
        assert unchanged, f"rank {rank}: weights scaled by a refused step"
    assert results[0][0] == results[1][0]
