"""The distributed training step on N ranks, split into phases, for every mode.

``python benchmarks/step.py --world N`` runs this. The byte-level GPT of
``benchmarks/common`` takes training steps (forward, backward, optimizer) on N
gloo ranks on a CPU (one thread each), or on N GPUs with NCCL when CUDA offers
that many, under each of these setups (all in the same processes, interleaved
step by step so that background load hits every setup alike):

=================== ==========================================================
``adamw_ddp``       ``torch.optim.AdamW`` (foreach) under stock DDP
``adamw_fsdp``      ``torch.optim.AdamW`` under FSDP2 (``fully_shard`` per block)
``muon_vanilla``    the paper's baseline: DDP all-reduces every gradient, then
                    every rank orthogonalises every matrix (DMuon ``mode="single"``
                    — the same kernels, so only the distribution differs)
``torch_muon_ddp``  the same baseline with ``torch.optim.Muon`` (standard NS,
                    Keller's coefficients) and AdamW for the other parameters
``owner_fsdp``      DMuon owner mode: ``fsdp.dedicate`` + ``fully_shard(ignored_params)``
``owner_ddp``       DMuon owner mode replacing DDP: ``ddp.dedicate``
``owner_ddp_zero1`` the same with the scalars owned too (``scalars="owner"``:
                    ZeRO-1-like sharded AdamW state, reduce + broadcast)
``owner_ddp_check1`` ``owner_ddp`` with ``check_every=1``: the rank-agreement
                    checksum every step, so its cost per check is the difference
``replicated``      DMuon ``mode="replicated"`` under stock DDP
``sharded``         DMuon sharded mode under stock FSDP2 (DTensor matrices)
``sign``            Sign-Muon, ``mode="sign"``: local gradients, packed vote
``adamw_tp``        tensor parallelism over all N ranks, the GPT with separate q/k/v
                    (each block's MLP ``fc`` and attention ``q``/``k``/``v`` colwise,
                    both ``proj`` rowwise, the attention only when N divides the
                    heads; ``benchmarks/common/tensor_parallel.py``),
                    ``torch.optim.AdamW``; every rank runs the whole global batch
``muon_tp_gather``  the same model, vanilla Muon that knows no tensor parallelism:
                    every rank all-gathers each split gradient and steps the whole
                    matrix (``GatherMuon``)
``tp_single``       the same model, DMuon ``mode="single"``: split matrices stepped
                    on their shards (``tp_path="auto"``: the Gram path or the
                    gather, by the cost model)
``adamw_dp_tp``     a ``dp × tp`` mesh (N/2 × 2): the blocks split over ``tp`` as above,
                    gradients averaged over ``dp`` (``average_over``, DDP's all-reduce),
                    each dp row on its part of the global batch; ``torch.optim.AdamW``
``muon_dp_tp_gather`` the same, vanilla Muon gathering every split matrix over ``tp``
                    (every rank steps every matrix whole)
``dp_tp_single``    the same, DMuon ``mode="single"``: every dp replica repeats the
                    shard-wise step of its tp group
``dp_tp_replicated`` the same, DMuon ``mode="replicated"`` with owners over ``dp``:
                    the owner's tp row steps the shards, the all-gather over ``dp``
                    carries shards
``adamw_fsdp_tp``   FSDP2 over tensor parallelism (torchtitan's layout): the blocks split
                    over ``tp``, then ``fully_shard`` on ``dp`` (blocks and model);
                    ``torch.optim.AdamW``
``fsdp_tp_sharded`` the same, DMuon ``mode="sharded"``: rows over ``dp`` to the owner,
                    whose tp row steps the shards (``tp_path="auto"``), rows back
``fsdp_tp_sharded_gram`` / ``fsdp_tp_sharded_gather``: the same with the Gram path or
                    the gather path forced (``tp_path=``)
``owner_dp_tp_gram`` / ``owner_dp_tp_gather``: the ``dp × tp`` model without DDP,
                    DMuon owner mode: ``ddp.dedicate(model, mesh)`` on the 2-D mesh,
                    each shard's gradient reduced over ``dp`` to its owner, whose tp
                    row steps the matrix (Gram path or gather path forced), the new
                    shards broadcast over ``dp``; the tensor-parallel scalars
                    all-reduced over ``dp``
=================== ==========================================================

Phases per step (host wall-clock; on a GPU each phase ends with a synchronize):
``forward`` (loss computed; includes FSDP2's all-gathers and, in owner mode, the
wait for the owners' broadcasts of the last step), ``backward`` (includes DDP's
and FSDP2's gradient reductions, which they overlap and wait for inside
backward), ``optimizer`` (``opt.step()``) and, inside it, ``comm_wait`` — the
engine's :class:`~dmuon.optim.StepReport` phase: waiting for the reductions to
owners, all-to-alls or votes. The step time of a setup is the slowest rank's.

Memory per rank: in one more step after the timed ones, untimed, at the end of its
backward (gradients and buckets both alive, the optimizer state of the steps before),
each setup's weights, gradients, optimizer state and DMuon's buffers, counted from
the tensors (:mod:`benchmarks.common.memory`: ``memory_bytes_per_rank``), and each
rank process's peak resident set
(``peak_rss_bytes_per_rank``, all setups of that rank together); on a GPU also
``torch.cuda.max_memory_allocated`` (``peak_cuda_bytes_per_rank``, likewise together).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common.data import BatchSampler
from benchmarks.common.memory import held_bytes
from benchmarks.common.model import GPT, GPTConfig
from benchmarks.common.tensor_parallel import (
    GatherMuon,
    average_over,
    parallelize_blocks,
    predicted_split_bytes,
)
from dmuon.comm import default_stats
from dmuon.optim.engine.tensor_split import GATHER_STATS_NAME, STATS_NAME

# Tensor parallelism over all ranks: every rank steps on the whole global batch.
TP_SETUPS = ("adamw_tp", "muon_tp_gather", "tp_single")
# FSDP2 over tensor parallelism: FSDP2 averages the gradients over dp itself.
FSDP_TP_SETUPS = (
    "adamw_fsdp_tp",
    "fsdp_tp_sharded",
    "fsdp_tp_sharded_gram",
    "fsdp_tp_sharded_gather",
)
# Owner mode over dp × tp: the dedication reduces the gradients over dp itself.
OWNER_TP_SETUPS = ("owner_dp_tp_gram", "owner_dp_tp_gather")
# A dp × tp mesh (N/2 × 2): each dp row on its part of the batch, averaged over dp
# (average_over, but for the FSDP2 and owner-mode ones).
DP_TP_SETUPS = (
    "adamw_dp_tp",
    "muon_dp_tp_gather",
    "dp_tp_single",
    "dp_tp_replicated",
    *FSDP_TP_SETUPS,
    *OWNER_TP_SETUPS,
)
SETUPS = (
    "adamw_ddp",
    "adamw_fsdp",
    "muon_vanilla",
    "torch_muon_ddp",
    "owner_fsdp",
    "owner_ddp",
    "owner_ddp_zero1",
    "owner_ddp_check1",
    "replicated",
    "sharded",
    "sign",
    *TP_SETUPS,
    *DP_TP_SETUPS,
)
# torch.optim.Muon runs Newton–Schulz in bf16, which on a CPU without AVX-512-BF16/AMX
# takes ~40× the fp32 time (minutes per step here): opt in with --setups.
# owner_ddp_zero1 differs from owner_ddp in the scalars only, owner_ddp_check1 in the
# rank-agreement check only: opt in with --setups.
# The tensor-parallel setups form their own comparison (the same model split over the
# ranks, the whole batch on each): --setups adamw_tp,muon_tp_gather,tp_single.
DEFAULT_SETUPS = tuple(
    s
    for s in SETUPS
    if s not in ("torch_muon_ddp", "owner_ddp_zero1", "owner_ddp_check1", *TP_SETUPS, *DP_TP_SETUPS)
)
LABELS = {
    "adamw_ddp": "AdamW, DDP",
    "adamw_fsdp": "AdamW, FSDP2",
    "muon_vanilla": "vanilla Muon (DDP, every rank NS)",
    "torch_muon_ddp": "torch.optim.Muon, DDP",
    "owner_fsdp": "DMuon owner + FSDP2",
    "owner_ddp": "DMuon owner, DDP replacement",
    "owner_ddp_zero1": "DMuon owner, DDP replacement, scalars owned",
    "owner_ddp_check1": "DMuon owner, DDP replacement, check_every=1",
    "replicated": "DMuon replicated + DDP",
    "sharded": "DMuon sharded + FSDP2",
    "sign": "DMuon Sign-Muon (sign)",
    "adamw_tp": "AdamW, tensor-parallel blocks",
    "muon_tp_gather": "vanilla Muon, TP (gather every shard)",
    "tp_single": "DMuon single, TP (on the shards, Gram or gather)",
    "adamw_dp_tp": "AdamW, dp × tp",
    "muon_dp_tp_gather": "vanilla Muon, dp × tp (gather over tp)",
    "dp_tp_single": "DMuon single, dp × tp (every dp replica steps)",
    "dp_tp_replicated": "DMuon replicated, dp × tp (owners over dp)",
    "adamw_fsdp_tp": "AdamW, FSDP2 over tp",
    "fsdp_tp_sharded": "DMuon sharded, FSDP2 over tp (owners over dp)",
    "fsdp_tp_sharded_gram": "DMuon sharded, FSDP2 over tp, Gram path forced",
    "fsdp_tp_sharded_gather": "DMuon sharded, FSDP2 over tp, gather path forced",
    "owner_dp_tp_gram": "DMuon owner, dp × tp (owners over dp), Gram path forced",
    "owner_dp_tp_gather": "DMuon owner, dp × tp (owners over dp), gather path forced",
}
PHASES = ("forward", "backward", "optimizer", "comm_wait")
#: torch threads of each rank (``run_on_ranks``' own default, on CPU and GPU alike): the
#: ranks share the machine's cores, and more threads per rank would oversubscribe them
THREADS_PER_RANK = 1


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    """Model and batch of the distributed step benchmark.

    The default is a configuration where Newton–Schulz dominates a vanilla Muon
    step (wide matrices, few tokens per rank) — the regime DMuon is for.
    """

    n_layer: int = 4
    d_model: int = 384
    n_head: int = 6
    seq_len: int = 64
    batch_per_rank: int = 4
    # fp32 Newton–Schulz on CPU: bf16 matmul is only fast with AVX-512-BF16/AMX; on a
    # CPU without them (e.g. the 2-core machine of the committed figures) a bf16
    # matmul is ~40× slower than fp32. None: the library's per-device default.
    ns_compute_dtype: str | None = "float32"

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.n_layer,
            d_model=self.d_model,
            n_head=self.n_head,
            seq_len=self.seq_len,
            seed=0,
        )


QUICK = WorldConfig(n_layer=2, d_model=128, n_head=4, seq_len=32, batch_per_rank=2)


def build(setup: str, cfg: WorldConfig, device: torch.device) -> tuple[Any, Any, Any]:
    """``(module to call, optimizer, dedication or None)`` for one setup on this rank.

    A ``dp × tp`` setup's optimizer carries ``dp_group`` (its gradients are averaged
    over it after backward, in the backward phase, as DDP's are).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp, fsdp
    from dmuon.optim import DMuon, param_groups

    gpt = cfg.gpt()
    if setup in TP_SETUPS or setup in DP_TP_SETUPS:  # q/k/v separate: attention split too
        gpt = dataclasses.replace(gpt, qkv="separate")
    model = GPT(gpt).to(device)
    world = dist.get_world_size()
    kw: dict[str, Any] = dict(lr=1e-3, weight_decay=0.1)
    if cfg.ns_compute_dtype is not None and device.type == "cpu":
        kw["ns_compute_dtype"] = cfg.ns_compute_dtype
    ded = None
    forward: Any = model
    if setup in ("adamw_fsdp", "owner_fsdp", "sharded"):
        mesh = init_device_mesh(device.type, (world,))
        ignored = None
        if setup == "owner_fsdp":
            ded = fsdp.dedicate(model, mesh)
            ignored = ded.params
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    elif setup in ("adamw_ddp", "muon_vanilla", "torch_muon_ddp", "replicated"):
        forward = DDP(model)
    elif setup in TP_SETUPS:
        parallelize_blocks(model, init_device_mesh(device.type, (world,), mesh_dim_names=("tp",)))
    elif setup in DP_TP_SETUPS:
        if world % 2:
            raise SystemExit(f"the dp × tp setups need an even --world (tp = 2), got {world}")
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_blocks(model, mesh["tp"])
        if setup in FSDP_TP_SETUPS:
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        elif setup in OWNER_TP_SETUPS:
            ded = ddp.dedicate(model, mesh)
    elif setup in ("owner_ddp", "owner_ddp_check1"):
        ded = ddp.dedicate(model)
    elif setup == "owner_ddp_zero1":
        ded = ddp.dedicate(model, scalars="owner")
    elif setup != "sign":
        raise ValueError(f"unknown setup {setup!r}; expected one of {SETUPS}")
    if setup in ("adamw_tp", "adamw_dp_tp", "adamw_fsdp_tp"):
        # foreach refuses DTensors and tensors, or DTensors of different meshes, in one call
        def mesh_of(p: torch.Tensor) -> int:
            return p.device_mesh.ndim if hasattr(p, "device_mesh") else 0  # type: ignore[attr-defined]

        kinds = sorted({mesh_of(p) for p in model.parameters()})
        groups = [{"params": [p for p in model.parameters() if mesh_of(p) == k]} for k in kinds]
        opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, foreach=True)
    elif setup.startswith("adamw"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    elif setup in ("muon_tp_gather", "muon_dp_tp_gather"):
        opt = GatherMuon(model, lambda groups: DMuon(groups, mode="single", **kw))
    elif setup in ("tp_single", "dp_tp_single"):
        opt = DMuon(param_groups(model), mode="single", **kw)
    elif setup.startswith("fsdp_tp_sharded"):
        path = {"fsdp_tp_sharded_gram": "gram", "fsdp_tp_sharded_gather": "gather"}
        opt = DMuon(param_groups(model), mode="sharded", tp_path=path.get(setup, "auto"), **kw)
    elif setup == "dp_tp_replicated":
        dp = mesh["dp"].get_group()
        opt = DMuon(param_groups(model), mode="replicated", process_group=dp, **kw)
    elif setup in OWNER_TP_SETUPS:
        path = setup.removeprefix("owner_dp_tp_")
        opt = DMuon(param_groups(model), distributed=ded, tp_path=path, **kw)
    elif setup == "torch_muon_ddp":
        from benchmarks.common.optimizers import build_optimizer

        opt = build_optimizer("torch_muon", model, lr=1e-3, scalar_lr=1e-3)
    elif setup == "muon_vanilla":
        opt = DMuon(param_groups(model), mode="single", **kw)
    elif setup == "replicated":
        opt = DMuon(param_groups(model), mode="replicated", **kw)
    elif setup == "sign":
        opt = DMuon(param_groups(model), rule="sign_muon", mode="sign", **kw)
    else:
        check = {"check_every": 1} if setup == "owner_ddp_check1" else {}
        opt = DMuon(param_groups(model), distributed=ded, **kw, **check)
    if setup in DP_TP_SETUPS:
        opt.dp_group, opt.dp_model = mesh["dp"].get_group(), model
    return forward, opt, ded


def rank_main(
    rank: int,
    world: int,
    setups: list[str],
    cfg: WorldConfig,
    steps: int,
    warmup: int,
    device_type: str,
) -> dict[str, Any]:
    """Inside each rank: build every setup, then time interleaved steps."""
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)

    def sync() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize(device)

    data = torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(0))
    sampler = BatchSampler(data.to(torch.uint8), cfg.batch_per_rank * world, cfg.seq_len)
    built = {s: build(s, cfg, device) for s in setups}
    times: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES} for s in setups}
    losses: dict[str, list[str]] = {s: [] for s in setups}  # exact (float.hex), every step
    memory: dict[str, dict[str, int]] = {}
    tp_bytes: dict[str, dict[str, float | None]] = {}  # the last step's, this rank
    last = warmup + steps  # one more, untimed step: the memory count at its end of backward
    for t in range(last + 1):
        mine = sampler.batch(t, rank=rank, world_size=world, device=device)
        whole = sampler.batch(t, device=device)  # tensor parallelism: the global batch
        for setup in setups:
            forward, opt, ded = built[setup]
            if setup in TP_SETUPS:
                x, y = whole
            elif setup in DP_TP_SETUPS:  # this dp row's part of the global batch
                row = dist.get_rank() // 2
                x, y = sampler.batch(t, rank=row, world_size=world // 2, device=device)
            else:
                x, y = mine
            dist.barrier()
            t0 = time.perf_counter()
            logits = forward(x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            sync()
            t1 = time.perf_counter()
            loss.backward()
            if setup in DP_TP_SETUPS and setup not in (*FSDP_TP_SETUPS, *OWNER_TP_SETUPS):
                average_over(opt.dp_model, opt.dp_group)
            sync()
            if setup in TP_SETUPS or setup in DP_TP_SETUPS:
                default_stats().reset()  # the step's tensor-parallel collectives alone
            t2 = time.perf_counter()
            if t == last:  # what the setup holds at the end of backward (its step untimed:
                # backward's collectives may still run on gloo's threads while it counts)
                memory[setup] = held_bytes(forward, opt, ded)
            opt.step()
            sync()
            t3 = time.perf_counter()
            if (setup in TP_SETUPS or setup in DP_TP_SETUPS) and t == warmup + steps - 1:
                measured = sum(
                    default_stats()[name].bytes_sent
                    for name in (STATS_NAME, GATHER_STATS_NAME)
                    if name in default_stats()
                )
                tp_bytes[setup] = {"measured": measured, "predicted": predicted_split_bytes(opt)}
            opt.zero_grad(set_to_none=True)
            if t == last:
                continue
            losses[setup].append(float(loss.detach()).hex())
            report = getattr(opt, "last_step", None)
            if t >= warmup:
                rec = times[setup]
                rec["forward"].append(t1 - t0)
                rec["backward"].append(t2 - t1)
                rec["optimizer"].append(t3 - t2)
                rec["comm_wait"].append(report.seconds.get("comm_wait", 0.0) if report else 0.0)
    info: dict[str, Any] = {
        "times": times,
        "imbalance": {},
        "matrices": {},
        "losses": losses,
        "tp_bytes": tp_bytes,
        "memory": memory,
        # the process's peak resident set (every setup of this rank together; KiB on Linux)
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device)
        if device_type == "cuda"
        else None,
    }
    for setup, (_, opt, ded) in built.items():
        if ded is not None:
            info["imbalance"][setup] = ded.plan.imbalance()
            ded.wait()
        report = getattr(opt, "last_step", None)
        if report is not None:
            info["matrices"][setup] = report.matrices
    dist.barrier()
    return info


def aggregate(per_rank: list[dict[str, Any]], setups: list[str]) -> dict[str, Any]:
    """Per setup and phase: the median over steps of the slowest rank's time."""
    out: dict[str, Any] = {}
    for setup in setups:
        phases = {}
        steps = len(per_rank[0]["times"][setup]["forward"])
        totals = [
            max(sum(r["times"][setup][p][i] for p in PHASES[:3]) for r in per_rank)
            for i in range(steps)
        ]
        for p in PHASES:
            phases[p] = statistics.median(
                max(r["times"][setup][p][i] for r in per_rank) for i in range(steps)
            )
        out[setup] = {
            "label": LABELS[setup],
            "seconds": phases,
            "total": statistics.median(totals),
            "all_totals": totals,
            "imbalance": per_rank[0]["imbalance"].get(setup),
            "matrices_per_rank": [r["matrices"].get(setup) for r in per_rank],
            # rank 0's loss at every step (warm-up included), exact: a refactor that
            # claims unchanged behaviour compares these bitwise
            "losses": per_rank[0]["losses"][setup],
            # bytes each rank sent in the tensor-parallel collectives of the last step
            # (CommStats) beside the α–β prediction (dmuon.comm.tensor_parallel_path)
            "tp_bytes_per_rank": [r.get("tp_bytes", {}).get(setup) for r in per_rank],
            # bytes each rank holds at the end of the untimed memory step's backward, counted
            # from the tensors (benchmarks/common/memory.py: weights, gradients, state, buffers)
            "memory_bytes_per_rank": [r["memory"].get(setup) for r in per_rank],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in per_rank],
            "peak_cuda_bytes_per_rank": [r["peak_cuda_bytes"] for r in per_rank],
        }
    return out


def summarise(rows: dict[str, Any]) -> dict[str, Any]:
    """Ratios to AdamW and to vanilla Muon, and the issue's targets (reported, never asserted)."""

    def ratio(a: str, b: str, key: str = "total") -> float | None:
        if a not in rows or b not in rows:
            return None
        num = rows[a]["total"] if key == "total" else rows[a]["seconds"][key]
        den = rows[b]["total"] if key == "total" else rows[b]["seconds"][key]
        return num / den if den > 0 else None

    adamw = "adamw_fsdp" if "adamw_fsdp" in rows else "adamw_ddp"
    for setup, row in rows.items():
        row["over_adamw"] = ratio(setup, adamw)
        same = "adamw_fsdp" if "fsdp" in setup or setup == "sharded" else "adamw_ddp"
        if setup in TP_SETUPS:
            same = "adamw_tp"
        elif setup in FSDP_TP_SETUPS:
            same = "adamw_fsdp_tp"
        elif setup in DP_TP_SETUPS:
            same = "adamw_dp_tp"
        row["over_adamw_same_stack"] = ratio(setup, same)
        row["over_vanilla"] = ratio(setup, "muon_vanilla")
        row["optimizer_over_vanilla"] = ratio(setup, "muon_vanilla", "optimizer")
    targets = {
        "optimizer_step_over_vanilla": {
            "target": 0.55,
            "owner_fsdp": ratio("owner_fsdp", "muon_vanilla", "optimizer"),
            "owner_ddp": ratio("owner_ddp", "muon_vanilla", "optimizer"),
            "owner_fsdp_over_torch_muon": ratio("owner_fsdp", "torch_muon_ddp", "optimizer"),
        },
        "vanilla_over_adamw_ddp": {
            "needs_at_least": 1.5,
            "value": ratio("muon_vanilla", "adamw_ddp"),
        },
        "end_to_end_over_adamw": {
            "target": 1.15,
            "owner_fsdp_over_adamw_fsdp": ratio("owner_fsdp", "adamw_fsdp"),
            "owner_ddp_over_adamw_ddp": ratio("owner_ddp", "adamw_ddp"),
        },
        "tensor_parallel": {
            "tp_single_over_gather_optimizer": ratio("tp_single", "muon_tp_gather", "optimizer"),
            "tp_single_over_adamw_tp": ratio("tp_single", "adamw_tp"),
            "gather_over_adamw_tp": ratio("muon_tp_gather", "adamw_tp"),
            "dp_tp_replicated_over_gather_optimizer": ratio(
                "dp_tp_replicated", "muon_dp_tp_gather", "optimizer"
            ),
            "dp_tp_replicated_over_single_optimizer": ratio(
                "dp_tp_replicated", "dp_tp_single", "optimizer"
            ),
            "dp_tp_replicated_over_adamw": ratio("dp_tp_replicated", "adamw_dp_tp"),
            "fsdp_tp_sharded_over_adamw_fsdp_tp": ratio("fsdp_tp_sharded", "adamw_fsdp_tp"),
            "fsdp_tp_sharded_over_gather_optimizer": ratio(
                "fsdp_tp_sharded", "muon_dp_tp_gather", "optimizer"
            ),
            "owner_dp_tp_gram_over_adamw": ratio("owner_dp_tp_gram", "adamw_dp_tp"),
            "owner_dp_tp_gram_over_gather_optimizer": ratio(
                "owner_dp_tp_gram", "muon_dp_tp_gather", "optimizer"
            ),
            "owner_dp_tp_gather_over_gather_optimizer": ratio(
                "owner_dp_tp_gather", "muon_dp_tp_gather", "optimizer"
            ),
        },
        "plan_imbalance": {
            "target": 0.05,
            "value": next(
                (r["imbalance"] for r in rows.values() if r["imbalance"] is not None), None
            ),
        },
    }
    return targets


def run_world(
    world: int,
    *,
    setups: list[str],
    cfg: WorldConfig,
    steps: int,
    warmup: int,
    device: str,
    timeout: float,
) -> dict[str, Any]:
    """Launch the ranks (gloo on CPU, NCCL on GPUs) and aggregate their timings."""
    from dmuon.comm.testing import run_on_ranks

    if device == "cuda":
        if torch.cuda.device_count() < world:
            raise SystemExit(
                f"--world {world} on cuda needs {world} GPUs, found {torch.cuda.device_count()}; "
                "use --device cpu for gloo ranks"
            )
        per_rank = run_on_ranks(
            rank_main,
            world,
            args=(setups, cfg, steps, warmup, device),
            timeout=timeout,
            backend="nccl",
            start_method="spawn",
        )
    else:
        per_rank = run_on_ranks(
            rank_main,
            world,
            args=(setups, cfg, steps, warmup, device),
            timeout=timeout,
            threads_per_rank=THREADS_PER_RANK,
        )
    rows = aggregate(per_rank, setups)
    return {
        "world_size": world,
        "backend": "nccl" if device == "cuda" else "gloo",
        "config": dataclasses.asdict(cfg),
        "parameters": GPT(cfg.gpt()).num_parameters(),
        "steps": steps,
        "warmup": warmup,
        "rows": rows,
        "targets": summarise(rows),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    cfg = result["config"]
    table = Table(
        title=(
            f"training step on {result['world_size']} {result['backend']} ranks — GPT "
            f"{cfg['n_layer']}×{cfg['d_model']}, {cfg['batch_per_rank']}×{cfg['seq_len']} "
            f"tokens per rank, ms (slowest rank, median of {result['steps']} steps)"
        )
    )
    heads = ("setup", "forward", "backward", "optimizer", "of it comm wait", "step")
    heads += ("× AdamW", "× vanilla", "opt × vanilla")
    for h in heads:
        table.add_column(h, justify="left" if h == "setup" else "right")
    for row in result["rows"].values():
        s = row["seconds"]
        table.add_row(
            row["label"],
            *(f"{s[p] * 1e3:.1f}" for p in PHASES),
            f"{row['total'] * 1e3:.1f}",
            _fmt(row["over_adamw_same_stack"], ".2f"),
            _fmt(row["over_vanilla"], ".2f"),
            _fmt(row["optimizer_over_vanilla"], ".2f"),
        )
    console.print(table)
    console.print(
        "× AdamW: against AdamW on the same stack (FSDP2 rows: FSDP2, TP rows: AdamW on the "
        "tensor-parallel model, others: DDP)"
    )
    for line in target_lines(result["targets"]):
        console.print(line)
    for row in result["rows"].values():
        per_rank = [b for b in row.get("tp_bytes_per_rank", []) if b and b["predicted"] is not None]
        if per_rank:
            console.print(
                f"{row['label']}: tensor-parallel bytes sent per rank, last step, measured "
                "(CommStats) / predicted (α–β): "
                + ", ".join(
                    f"{b['measured'] / 1e6:.3f} / {b['predicted'] / 1e6:.3f} MB" for b in per_rank
                )
            )


def target_lines(t: dict[str, Any]) -> list[str]:
    """The issue's targets as sentences, met or not."""

    def verdict(value: float | None, limit: float, below: bool = True) -> str:
        if value is None:
            return "not measured"
        ok = value <= limit if below else value >= limit
        return f"{value:.2f} ({'met' if ok else 'NOT met'})"

    o = t["optimizer_step_over_vanilla"]
    e = t["end_to_end_over_adamw"]
    v = t["vanilla_over_adamw_ddp"]["value"]
    imb = t["plan_imbalance"]["value"]
    return [
        f"DMuon optimizer step / vanilla Muon's (target ≤ 0.55): owner+FSDP2 "
        f"{verdict(o['owner_fsdp'], 0.55)}, owner DDP-replacement {verdict(o['owner_ddp'], 0.55)}; "
        f"owner+FSDP2 / torch.optim.Muon's {verdict(o['owner_fsdp_over_torch_muon'], 0.55)}",
        f"vanilla Muon step / AdamW's (the target below needs ≥ 1.5): {verdict(v, 1.5, False)}",
        f"DMuon step / AdamW's (target ≤ 1.15): owner+FSDP2 / AdamW FSDP2 "
        f"{verdict(e['owner_fsdp_over_adamw_fsdp'], 1.15)}, owner DDP-replacement / AdamW DDP "
        f"{verdict(e['owner_ddp_over_adamw_ddp'], 1.15)}",
        "plan imbalance (target ≤ 5%): "
        + (
            "not measured"
            if imb is None
            else f"{100 * imb:.1f}% ({'met' if imb <= 0.05 else 'NOT met'})"
        ),
        "tensor parallelism, optimizer step of DMuon on the shards / vanilla Muon's that "
        "gathers them: " + _fmt(t["tensor_parallel"]["tp_single_over_gather_optimizer"], ".2f"),
        "dp × tp, optimizer step of DMuon replicated (owners over dp, shards over tp) / "
        "vanilla Muon's that gathers over tp: "
        + _fmt(t["tensor_parallel"].get("dp_tp_replicated_over_gather_optimizer"), ".2f")
        + "; / DMuon single's (every dp replica steps): "
        + _fmt(t["tensor_parallel"].get("dp_tp_replicated_over_single_optimizer"), ".2f"),
        "FSDP2 over tp, step of DMuon sharded (owners over dp, shards over tp) / AdamW's: "
        + _fmt(t["tensor_parallel"].get("fsdp_tp_sharded_over_adamw_fsdp_tp"), ".2f")
        + "; optimizer step / vanilla Muon's that gathers over tp (DDP × tp): "
        + _fmt(t["tensor_parallel"].get("fsdp_tp_sharded_over_gather_optimizer"), ".2f"),
        "dp × tp, step of DMuon owner mode (dedicate over the mesh) / AdamW's: Gram path "
        + _fmt(t["tensor_parallel"].get("owner_dp_tp_gram_over_adamw"), ".2f")
        + "; optimizer step (its reductions' wait included) / vanilla Muon's that gathers "
        "over tp: Gram path "
        + _fmt(t["tensor_parallel"].get("owner_dp_tp_gram_over_gather_optimizer"), ".2f")
        + ", gather path "
        + _fmt(t["tensor_parallel"].get("owner_dp_tp_gather_over_gather_optimizer"), ".2f"),
    ]


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(result["rows"].values())
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.8))
    left = [0.0] * len(rows)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "compute": "tab:green"}
    parts = {
        "forward": [r["seconds"]["forward"] * 1e3 for r in rows],
        "backward": [r["seconds"]["backward"] * 1e3 for r in rows],
        "compute": [
            max(0.0, r["seconds"]["optimizer"] - r["seconds"]["comm_wait"]) * 1e3 for r in rows
        ],
        "comm_wait": [r["seconds"]["comm_wait"] * 1e3 for r in rows],
    }
    labels = {
        "forward": "forward",
        "backward": "backward (incl. DDP/FSDP2 reductions)",
        "compute": "optimizer",
        "comm_wait": "optimizer: comm wait",
    }
    for key, values in parts.items():
        ax.barh(
            range(len(rows)),
            values,
            left=left,
            color=colors.get(key, "tab:red"),
            label=labels[key],
        )
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step (slowest rank, median)")
    cfg = result["config"]
    ax.set_title(
        f"{result['world_size']} {result['backend']} ranks, GPT {cfg['n_layer']}×{cfg['d_model']}, "
        f"{cfg['batch_per_rank']}×{cfg['seq_len']} tokens/rank",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
