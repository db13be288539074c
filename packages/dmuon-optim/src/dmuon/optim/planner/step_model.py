"""The step-time model: a training step of AdamW, vanilla distributed Muon and DMuon.

For ``N`` data-parallel ranks, a model of ``Φ`` parameters (``Φ_a`` active per
token; ``Φ_M`` in Muon matrices, ``Φ_S`` scalar), ``T`` tokens per step and a device
of peak rate ``F`` (FLOP/s) and memory bandwidth ``B_mem``:

* **forward + backward** ``t_fb = 6·Φ_a·T / (N·MFU·F)`` (Kaplan et al. 2020,
  *Scaling Laws for Neural Language Models*, §2.1: 2 FLOPs per parameter and token
  forward, 4 backward), or a measured ``t_fb`` (``--fwd-bwd-ms``). Forward is
  ``t_f = t_fb/3``, backward ``t_b = 2·t_fb/3``.
* **Newton–Schulz** on rank ``r``: ``t_ns(r) = Σ_calls [c₀ + b·(ns_flops(m,n)/(η·F) +
  p·m·n·e/(η_mem·B_mem))]`` — :class:`dmuon.comm.NSCost` over the batched rule calls
  the engine makes for the matrices the owner plan (:func:`dmuon.comm.plan_owners`
  with that cost) gives the rank: one per shape within each step unit (owner mode's
  layer or pack, a layer of ``replicated``/``sharded``;
  :mod:`~dmuon.optim.planner.rule_calls`), at kernel efficiency ``η`` and memory
  efficiency ``η_mem`` from the profile. DMuon waits for ``max_r t_ns(r)``; vanilla
  Muon runs every matrix on every rank, one batch per shape, and Sign-Muon every
  matrix on every rank, layer by layer (``engine/sign.py``). A
  calibrated profile adds ``o`` seconds per matrix stepped (momentum, update and
  bookkeeping measured around the NS calls; 0 for datasheet profiles). Sign-Muon adds
  ``o_sign`` per matrix (its sign and spectral-normalisation links beyond Muon's chain)
  and ``v`` per element voted (packing, counting and unpacking the signs), both
  calibrated (0 for datasheet profiles).
* **AdamW** is memory bound: per element it reads the parameter, gradient and both
  moments and writes the parameter and moments, ``3e + 16`` bytes (fp32 moments,
  parameters and gradients of ``e`` bytes), so ``t_adam = k·(3e+16)/(η_mem·B_mem)``
  for the ``k`` elements a rank steps.
* **A collective** costs ``steps·α + max(sent, received)/(η_link·B_link)``
  (:func:`dmuon.comm.cost_model`'s Hockney form; the collectives one layer issues
  together pay ``α`` once) with the bytes of
  :mod:`~dmuon.optim.planner.traffic`; a group within one node runs at the
  intra-node link, one that spans nodes at the inter-node link. FSDP2's collectives
  also copy ``2·B·(1 + 1/N)`` bytes in and out of their buffers
  (:func:`~dmuon.optim.planner.traffic.fsdp_copied_bytes`): ``t_copy`` at ``η_mem·B_mem``,
  compute-side work (the copy-out runs on the compute stream), so it adds to the step
  and to the window its phase's transfers hide behind.
* **Overlap, as the engine does it.** Transfers launched per layer from backward
  hooks (DMuon's reduce to owners, FSDP2's reduce-scatter, DDP's all-reduce)
  overlap the rest of backward; transfers awaited by the next forward (DMuon's
  broadcast of updated weights, FSDP2's all-gather) overlap forward. With ``L``
  layers, a phase's communication ``c`` against a compute window ``w`` leaves
  ``exposed = max(c/L, c − w)`` — the last layer's share can never hide. Transfers
  inside the optimizer step (replicated all-gather, sharded all-to-alls) are
  pipelined with Newton–Schulz layer by layer: ``t_opt = max(c, t_ns) +
  min(c, t_ns)/L``. Sign-Muon's votes are synchronous: ``t_opt = t_ns + c``. A
  profile with ``overlap=False`` (a calibrated CPU) exposes all communication.
* **Step** ``t = t_fb + t_copy + exposed_forward + exposed_backward + t_opt``; overhead vs
  AdamW ``t/t_AdamW − 1``; speedup vs vanilla ``t_vanilla/t``.
* **Tensor and expert parallelism** (``TrainingShape.tp``/``ep``): the model as one
  rank holds it, owners over ``dp = N/T``, each split matrix by its tensor-parallel
  path, whose collectives add ``t_tp`` to Newton–Schulz (never hidden), experts held
  where they live (:mod:`~dmuon.optim.planner.parallel`). A batched call of split
  matrices takes the path the engine takes for that call and pays its collectives
  once (:class:`~dmuon.optim.planner.parallel.SplitPricer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dmuon.comm import MatrixItem, NSCost, OwnerPlan, plan_owners
from dmuon.kernels import ns_flops
from dmuon.optim.batch_cuts import default_batch_elements
from dmuon.optim.engine.layer_packing import DEFAULT_PACK_MB
from dmuon.optim.engine.params import subplan
from dmuon.optim.planner.config import ModelSpec
from dmuon.optim.planner.memory import memory_per_rank
from dmuon.optim.planner.parallel import (
    NS_COMPUTE_BYTES,
    Layout,
    SplitChoice,
    SplitPricer,
    expert_transfers,
    layout,
    rank_work,
    tp_transfers,
    vanilla_tp_gather,
)
from dmuon.optim.planner.profiles import ClusterProfile, Link
from dmuon.optim.planner.rule_calls import rule_calls, unit_flops, unit_work
from dmuon.optim.planner.traffic import (
    DMUON_MODES,
    OWNER_MODES,
    Transfer,
    dmuon_transfers,
    framework_transfers,
    owned_scalar_items,
    step_units,
)
from dmuon.optim.rules import RULES

__all__ = ["ALL_MODES", "ModePrediction", "Prediction", "TrainingShape", "predict"]

ALL_MODES = ("adamw", "vanilla", *DMUON_MODES)
"""What :func:`predict` reports by default: the two baselines and every DMuon mode."""

DDP_BASELINES = ("adamw-ddp", "vanilla-ddp")
"""Baselines under stock DDP (every rank steps everything after an all-reduce), as
``benchmarks/step.py``'s ``adamw_ddp`` and ``muon_vanilla``; ask for them in ``modes``."""


@dataclass(frozen=True)
class TrainingShape:
    """The training shape.

    Attributes:
        global_tokens: tokens per optimizer step over all ranks.
        seq_len: sequence length (reported; the 6·Φ·T count does not use it).
        mfu: model FLOPs utilisation of forward + backward.
        fwd_bwd_s: a measured forward + backward time per rank (overrides ``mfu``).
        method: Newton–Schulz method (``"gram"`` or ``"standard"``).
        ns_steps: Newton–Schulz steps.
        restarts: Gram restart iterations.
        tp: tensor-parallel degree ``T`` (a ``dp × tp`` mesh, ``dp = N/T``).
        ep: expert-parallel degree ``E_p`` (expert stacks split over ``E_p`` dp ranks).
        tp_path: how a split matrix is orthogonalised: ``"auto"`` (the cheaper by
            :func:`dmuon.comm.tensor_parallel_path`), ``"gram"`` or ``"gather"``.
        rule: DMuon's matrix rule (:data:`~dmuon.optim.RULES`): which state each matrix
            keeps (``muon``: the momentum; ``adamuon``: also a full second moment;
            ``normuon``: also one value per row).
        state_dtype: the dtype of the matrix rule's state (DMuon's ``state_dtype``):
            ``None`` (the parameter's), ``"float32"`` or ``"bfloat16"``.
        ns_compute_dtype: the Newton–Schulz compute dtype (DMuon's ``ns_compute_dtype``),
            in which the tensor-parallel Gram path's all-reduces travel: ``"float16"``
            (a GPU's default for Gram Newton–Schulz), ``"bfloat16"`` or ``"float32"``.
    """

    global_tokens: int = 4 * 1024 * 1024
    seq_len: int = 4096
    mfu: float = 0.4
    fwd_bwd_s: float | None = None
    method: str = "gram"
    ns_steps: int = 5
    restarts: tuple[int, ...] = (2,)
    tp: int = 1
    ep: int = 1
    tp_path: str = "auto"
    rule: str = "muon"
    state_dtype: str | None = None
    ns_compute_dtype: str = "float16"

    def __post_init__(self) -> None:
        if isinstance(self.global_tokens, bool) or not isinstance(self.global_tokens, int):
            raise ValueError(f"global_tokens must be an int ≥ 1, got {self.global_tokens!r}")
        if self.global_tokens < 1 or self.seq_len < 1:
            raise ValueError(
                f"global_tokens and seq_len must be ≥ 1, got {self.global_tokens}, {self.seq_len}"
            )
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if self.fwd_bwd_s is not None and not 0 < self.fwd_bwd_s < math.inf:
            raise ValueError(
                f"fwd_bwd_s (--fwd-bwd-ms) must be a finite number > 0, got {self.fwd_bwd_s!r}"
            )
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int):
            raise ValueError(f"ns_steps (--ns-steps) must be an integer ≥ 1, got {self.ns_steps!r}")
        if self.ns_steps < 1:
            raise ValueError(f"ns_steps (--ns-steps) must be an integer ≥ 1, got {self.ns_steps!r}")
        if self.method not in ("gram", "standard"):
            raise ValueError(f"method must be 'gram' or 'standard', got {self.method!r}")
        for flag, value in (("--tp", self.tp), ("--ep", self.ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be an integer ≥ 1, got {value!r}")
        if self.tp_path not in ("auto", "gram", "gather"):
            raise ValueError(f"--tp-path must be auto, gram or gather, got {self.tp_path!r}")
        if self.rule not in RULES:
            raise ValueError(f"--rule must be one of {sorted(RULES)}, got {self.rule!r}")
        if self.ns_compute_dtype not in NS_COMPUTE_BYTES:
            raise ValueError(
                f"--ns-compute-dtype must be one of {sorted(NS_COMPUTE_BYTES)}, "
                f"got {self.ns_compute_dtype!r}"
            )
        if self.state_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                f"--state-dtype must be float32 or bfloat16 (or unset: the parameter's dtype), "
                f"got {self.state_dtype!r}"
            )


@dataclass
class ModePrediction:
    """The prediction for one mode (seconds, bytes, FLOPs per rank).

    ``copies_s`` is the frameworks' copying around their collectives (FSDP2's copy-in
    and copy-out), work of the compute side: it adds to the step and, where
    communication overlaps, widens the window that hides it.
    """

    mode: str
    fwd_bwd_s: float
    ns_s: float
    adamw_s: float
    comm_s: dict[str, float]
    exposed_s: dict[str, float]
    optimizer_s: float
    step_s: float
    ns_flops_max: int
    ns_flops_mean: float
    bytes_dmuon: float
    bytes_framework: float
    memory: dict[str, float]
    transfers: list[Transfer] = field(default_factory=list)
    overhead_vs_adamw: float = 0.0
    speedup_vs_vanilla: float = 1.0
    tp_s: float = 0.0
    bytes_tp: float = 0.0
    copies_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (see the schema in :mod:`~dmuon.optim.planner.report`)."""
        return {
            "mode": self.mode,
            "fwd_bwd_ms": self.fwd_bwd_s * 1e3,
            "ns_ms": self.ns_s * 1e3,
            "adamw_ms": self.adamw_s * 1e3,
            "comm_ms": {k: v * 1e3 for k, v in self.comm_s.items()},
            "exposed_comm_ms": {k: v * 1e3 for k, v in self.exposed_s.items()},
            "optimizer_ms": self.optimizer_s * 1e3,
            "step_ms": self.step_s * 1e3,
            "ns_flops_per_rank_max": self.ns_flops_max,
            "ns_flops_per_rank_mean": self.ns_flops_mean,
            "bytes_per_rank_dmuon": self.bytes_dmuon,
            "bytes_per_rank_framework": self.bytes_framework,
            "tp_ms": self.tp_s * 1e3,
            "bytes_per_rank_tp": self.bytes_tp,
            "framework_copies_ms": self.copies_s * 1e3,
            "memory_bytes": self.memory,
            "overhead_vs_adamw": self.overhead_vs_adamw,
            "speedup_vs_vanilla": self.speedup_vs_vanilla,
            "transfers": [
                {
                    "op": t.op,
                    "collective": t.collective,
                    "phase": t.phase,
                    "bytes_per_rank_max": t.max_bytes,
                    "collectives": t.collectives,
                    "recorded_by_commstats": t.recorded,
                }
                for t in self.transfers
            ],
        }


@dataclass
class Prediction:
    """Everything :func:`predict` found."""

    spec: ModelSpec
    cluster: ClusterProfile
    shape: TrainingShape
    plan: OwnerPlan
    modes: dict[str, ModePrediction]
    assumptions: list[tuple[str, str]]
    layout: Layout | None = None
    owner_loads: tuple[float, ...] = ()
    """Each dp rank's owner-mode work under the plan's owners, as the engine runs it:
    Newton–Schulz in its rule calls per step unit, the tp collectives inside them, and
    the per-matrix overhead (seconds; empty for a prediction made without it). The
    plan's own ``loads`` batch a rank's same-shape matrices across layers instead."""

    @property
    def owner_imbalance(self) -> float:
        """``max / mean − 1`` of :attr:`owner_loads` (0 when empty or all zero)."""
        if not self.owner_loads:
            return 0.0
        mean = sum(self.owner_loads) / len(self.owner_loads)
        return max(0.0, max(self.owner_loads) / mean - 1.0) if mean > 0 else 0.0


def ns_cost(cluster: ClusterProfile, shape: TrainingShape) -> NSCost:
    """The profile's :class:`~dmuon.comm.NSCost` (rates in seconds)."""
    d = cluster.device
    return NSCost(
        method=shape.method,
        steps=shape.ns_steps,
        restarts=shape.restarts,
        flops_per_second=d.ns_flops_per_second,
        bytes_per_second=d.bytes_per_second,
        call_overhead=d.call_overhead,
    )


def plan_flops(plan: OwnerPlan, shape: TrainingShape) -> list[int]:
    """Newton–Schulz FLOPs per rank (:func:`dmuon.kernels.ns_flops` of each owned item)."""
    return [
        sum(
            ns_flops(
                i.rows,
                i.cols,
                method=shape.method,
                steps=shape.ns_steps,
                restarts=shape.restarts,
                batch=i.batch,
            )
            for i in plan.items_of(r)
        )
        for r in range(plan.world_size)
    ]


def batch_elements(cluster: ClusterProfile) -> int:
    """Matrix entries per batched rule call on the profile's device, as the engine cuts
    them (:func:`dmuon.optim.batch_cuts.default_batch_elements`): ``2²⁰`` for a profile
    calibrated on a CPU, no cap otherwise (a GPU's)."""
    machine = cluster.device.measured.get("machine")
    cpu = isinstance(machine, dict) and "gpu" in machine and machine["gpu"] is None
    return default_batch_elements("cpu" if cpu else "cuda")


def collective_seconds(t: Transfer, cluster: ClusterProfile) -> float:
    """α–β time of a transfer on the busiest rank: ``rounds·steps·α + bytes/(η·B)``.

    ``steps`` is the collective's latency steps (``2(N−1)`` for an all-reduce, ``N−1``
    otherwise, :func:`dmuon.comm.cost_model`); ``rounds`` the times they are paid in
    sequence (once per layer for collectives a layer issues together).
    """
    link = cluster.link(t.group_size * t.stride)
    n = t.group_size
    steps_per = 2 * (n - 1) if t.collective == "all_reduce" else n - 1
    return t.rounds * steps_per * link.alpha + t.max_bytes / link.bandwidth_for(t.collective)


def _exposed(comm: float, window: float, layers: int) -> float:
    return max(comm / layers, comm - window) if comm > 0 else 0.0


def predict(
    spec: ModelSpec,
    cluster: ClusterProfile,
    shape: TrainingShape,
    *,
    modes: tuple[str, ...] = ALL_MODES,
    plan: OwnerPlan | None = None,
) -> Prediction:
    """Predict the step of every mode in ``modes`` (``adamw`` and ``vanilla`` always).

    With ``shape.tp = T > 1`` or ``shape.ep > 1`` the model is laid out by
    :func:`~dmuon.optim.planner.parallel.layout`: owners over the ``dp = N/T``
    data-parallel ranks, shards over ``tp``, experts held where they live.

    ``plan`` (default: :func:`dmuon.comm.plan_owners` of the matrices with the profile's
    NS cost) is the owner plan of the matrices; ``owner-ddp-zero1`` plans the matrices
    and the scalars together (:func:`~dmuon.optim.planner.traffic.owned_scalar_items`),
    unless ``plan`` holds the scalars too (``ddp.dedicate(scalars="owner")``'s plan): then
    that mode takes it whole and the others its matrices.

    Raises:
        ValueError: an unknown mode, a model without Muon matrices, or a ``tp``/``ep``
            the model or the cluster cannot take (naming ``--tp``/``--ep``).

    Examples:
        >>> from dmuon.optim.planner.config import load_model
        >>> from dmuon.optim.planner.profiles import DEVICES, INTERCONNECTS, ClusterProfile
        >>> cluster = ClusterProfile(DEVICES["H100"], 8, 8, INTERCONNECTS["nvlink4"],
        ...                          INTERCONNECTS["ib-ndr"])
        >>> p = predict(load_model("gpt2"), cluster, TrainingShape(global_tokens=2**19))
        >>> p.modes["owner"].ns_s < p.modes["vanilla"].ns_s
        True
    """
    bad = [m for m in modes if m not in ALL_MODES + DDP_BASELINES]
    if bad:
        raise ValueError(f"modes must be among {ALL_MODES + DDP_BASELINES}, got {bad}")
    if not spec.matrices:
        raise ValueError(f"model {spec.name!r} has no Muon matrices to plan")
    N = cluster.gpus
    d = cluster.device
    cost = ns_cost(cluster, shape)
    lay = layout(spec, N, shape.tp, shape.ep, cost=cost)
    D, T = lay.dp, lay.tp
    local = lay.local
    held = lay.held or tuple(() for _ in range(D))
    scalar_names = {n for n, _ in local.scalars}
    given_zero1 = None
    if plan is not None and scalar_names and scalar_names <= set(plan.names):
        # ddp.dedicate(scalars="owner")'s plan: owner-ddp-zero1's; the others', its matrices
        given_zero1 = plan
        plan = subplan(plan, [n for n in plan.names if n not in scalar_names])
    if plan is None:
        plan = plan_owners(lay.dense, D, cost=cost, held=lay.held)
    # vanilla: every dense matrix whole (a split one gathered over tp) and its own experts
    mine = (*lay.dense, *(i for i in local.matrices if len(i.shape) > 2 and lay.ep > 1))
    single = plan_owners(mine, 1, cost=cost)
    # the split matrices' batched calls, priced as the engine runs each: the path its
    # tp_path="auto" takes for the call's batch, at the profile's rates
    pricer = SplitPricer(
        lay,
        cluster,
        shape.method,
        shape.ns_steps,
        shape.tp_path,
        shape.state_dtype,
        NS_COMPUTE_BYTES[shape.ns_compute_dtype],
    )

    def on_shards(p: OwnerPlan) -> OwnerPlan:
        """``p`` as it travels over dp: each rank's shard of a split matrix."""
        if T == 1:
            return p
        return subplan(p, p.names, {n: lay.shard_shape(p.item(n)) for n in lay.splits})

    local_plan = on_shards(plan)
    # ddp.dedicate(scalars="owner"): its own plan, of the matrices and the scalars whole
    # (traffic.owned_scalar_items), whose owners step the scalars with AdamW
    zero1_plan = local_zero1 = plan
    if "owner-ddp-zero1" in modes:
        zero1_plan = given_zero1 or plan_owners(
            [*lay.dense, *owned_scalar_items(local)], D, cost=cost, held=lay.held
        )
        local_zero1 = on_shards(zero1_plan)
    layers = max(1, len(spec.layers))
    e = spec.matrices[0].dtype.itemsize
    if shape.fwd_bwd_s is not None:
        t_fb = shape.fwd_bwd_s
    else:
        t_fb = 6 * spec.active_params * shape.global_tokens / (N * shape.mfu * d.peak_flops)
    t_f, t_b = t_fb / 3, 2 * t_fb / 3
    adam_rate = (3 * e + 16) / d.bytes_per_second

    all_flops = int(
        rank_work(
            single.items, {}, cost, method=shape.method, steps=shape.ns_steps,
            restarts=shape.restarts,
        )[2]
    )  # fmt: skip
    # per-matrix optimizer work beyond NS (calibrated; 0 for datasheet profiles)
    per_matrix = d.matrix_overhead
    busiest = max(sum(i.batch for i in (*plan.items_of(r), *held[r])) for r in range(D))
    busiest_s = busiest * per_matrix
    everything = sum(i.batch for i in single.items) * per_matrix
    # Sign-Muon's own work beyond Muon's (calibrated; 0 for datasheet profiles): its
    # chain on every matrix, and the vote's packing and counting on every element
    sign_extra = (
        sum(i.batch for i in single.items) * d.sign_overhead + local.matrix_params * d.vote_overhead
    )
    # every DMuon mode: each rank's rule calls per step unit, as the engine batches them
    # (rule_calls.py), not plan_owners' batching across layers; sign mode steps every
    # matrix on every rank, layer by layer (engine/sign.py)
    limit = batch_elements(cluster)
    pack_mb = DEFAULT_PACK_MB if T == 1 else 0  # a tensor-parallel model packs nothing

    def pack_of(mode: str) -> float:
        """The pack limit of ``mode``'s units: replicated mode steps expert stacks split
        over ep on their shards, and then packs no layers (``PlannedEngine._pack``)."""
        return 0 if mode == "replicated" and lay.ep > 1 else pack_mb

    by_units: dict[tuple[object, ...], list[list[list[MatrixItem]]]] = {}

    def calls_of(mode: str) -> list[list[list[MatrixItem]]]:
        """Each dp rank's batched rule calls in ``mode`` (``owner-ddp-zero1``: the
        matrices of its plan; the owned scalars are AdamW's)."""
        zero1 = mode == "owner-ddp-zero1"
        if mode == "sign":
            units = step_units(local, single, mode, layer_pack_mb=pack_mb)
        else:
            units = step_units(
                local, local_zero1 if zero1 else local_plan, mode, layer_pack_mb=pack_of(mode)
            )
        key = (mode == "sign", zero1, *(tuple(u) for u in units))
        if key not in by_units:
            if mode == "sign":
                every = rule_calls(single.items, units, batch_limit=limit, splits=lay.splits)
                by_units[key] = [every] * D
            else:
                source = zero1_plan if zero1 else plan
                by_units[key] = [
                    rule_calls(
                        [i for i in source.items_of(r) if i.name not in scalar_names],
                        units,
                        batch_limit=limit,
                        splits=lay.splits,
                        held=held[r],
                    )
                    for r in range(D)
                ]
        return by_units[key]

    def flops_of(calls: list[list[MatrixItem]]) -> float:
        return unit_flops(
            calls, pricer, method=shape.method, steps=shape.ns_steps, restarts=shape.restarts
        )

    # the path each split matrix takes in owner mode's calls (the assumptions' count)
    choices: dict[str, SplitChoice] = {}
    if T > 1:
        for calls in calls_of("owner"):
            for call in calls:
                if call and call[0].name in lay.splits:
                    choices.update((i.name, pricer(call)) for i in call)
    held_numel = [sum(i.numel for i in h) for h in held]
    experts_local = sum(i.numel for i in local.matrices if len(i.shape) > 2) if lay.ep > 1 else 0
    out: dict[str, ModePrediction] = {}
    for mode in dict.fromkeys(("adamw", "vanilla", *modes)):
        # the plan that travels in this mode (ddp.dedicate(scalars="owner"): its own)
        mode_plan = local_zero1 if mode == "owner-ddp-zero1" else local_plan
        t_tp = 0.0
        dm: list[Transfer] = []
        if mode in ("adamw", "adamw-ddp"):
            t_ns, f_max, f_mean = 0.0, 0, 0.0
            t_adam = local.total_params / (D if mode == "adamw" else 1) * adam_rate
        elif mode == "vanilla-ddp":
            t_ns, f_max, f_mean = single.max_load + everything, all_flops, float(all_flops)
            t_adam = local.scalar_params * adam_rate
        elif mode == "vanilla":
            t_ns, f_max, f_mean = single.max_load + everything, all_flops, float(all_flops)
            t_adam = local.scalar_params / D * adam_rate
        elif mode == "sign":
            dm = dmuon_transfers(local, local_plan, mode, batch_limit=limit, layer_pack_mb=pack_mb)
            calls = calls_of(mode)[0]
            t_ns, t_tp = unit_work(calls, cost, pricer=pricer)
            t_ns += everything + sign_extra
            f_max = int(flops_of(calls))
            f_mean = float(f_max)
            t_adam = local.scalar_params * adam_rate
        elif mode == "owner-ddp-zero1":
            dm = dmuon_transfers(local, mode_plan, mode, layer_pack_mb=pack_mb)
            if lay.expert_plan is not None and lay.replicas > 1:
                dm += expert_transfers(lay, mode)
            ranks = [unit_work(calls, cost, pricer=pricer) for calls in calls_of(mode)]
            # each owner steps its matrices (Newton–Schulz) and its scalars (AdamW): the
            # step waits for the rank whose sum is the largest
            owned = [zero1_plan.items_of(r) for r in range(D)]
            own_s = [sum(i.numel for i in its if i.name in scalar_names) for its in owned]
            own_m = [
                sum(i.batch for i in (*its, *held[r]) if i.name not in scalar_names)
                for r, its in enumerate(owned)
            ]
            top = max(
                range(D),
                key=lambda r: sum(ranks[r]) + own_m[r] * per_matrix + own_s[r] * adam_rate,
            )
            t_ns, t_tp = ranks[top][0] + own_m[top] * per_matrix, ranks[top][1]
            t_adam = own_s[top] * adam_rate
            flops = [flops_of(calls) for calls in calls_of(mode)]
            f_max, f_mean = int(max(flops)), sum(flops) / D
        else:
            # a tensor-parallel model's exchange packs no layers (its matrices are DTensors)
            dm = dmuon_transfers(local, local_plan, mode, layer_pack_mb=pack_of(mode))
            if lay.expert_plan is not None and lay.replicas > 1:
                dm += expert_transfers(lay, mode)
            ranks = [unit_work(calls, cost, pricer=pricer) for calls in calls_of(mode)]
            top = max(range(D), key=lambda r: ranks[r][0] + ranks[r][1])
            t_ns, t_tp = ranks[top][0] + busiest_s, ranks[top][1]
            flops = [flops_of(calls) for calls in calls_of(mode)]
            f_max, f_mean = int(max(flops)), sum(flops) / D
            # replicated and ddp.dedicate's owner mode: every rank steps every scalar
            every_scalar = mode in ("replicated", "owner-ddp")
            scalars = local.scalar_params if every_scalar else local.scalar_params / D
            t_adam = scalars * adam_rate
        fw = framework_transfers(local, mode, D)
        for t in dm + fw:  # a dp group's ranks are T apart (tp innermost)
            t.stride *= T
        if T > 1 and mode in ("vanilla", "vanilla-ddp"):
            fw.append(vanilla_tp_gather(spec, lay, layers))
        tp_moved = []
        if lay.splits and mode in DMUON_MODES:
            tp_moved = tp_transfers(
                choices,
                mode_plan,
                held,
                mode,
                D,
                calls=calls_of(mode),
                pricer=pricer,
            )
        transfers = dm + fw + tp_moved
        comm = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        copies = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for t in dm + fw:
            comm[t.phase] += collective_seconds(t, cluster)
            copies[t.phase] += t.copied / d.bytes_per_second
        t_copies = sum(copies.values())
        if d.overlap:  # the copies run with the compute (FSDP2's copy-out: on its stream)
            exposed = {
                "forward": _exposed(comm["forward"], t_f + copies["forward"], layers),
                "backward": _exposed(comm["backward"], t_b + copies["backward"], layers),
            }
        else:  # nothing hides behind compute (a calibrated CPU profile)
            exposed = {"forward": comm["forward"], "backward": comm["backward"]}
        c = comm["step"]
        # the tp collectives sit inside Newton–Schulz (the Gram all-reduces between its
        # products, the gather before it): synchronous with it, never hidden
        t_work = t_ns + t_tp
        if mode in ("sign", "vanilla", "vanilla-ddp") or not d.overlap:
            t_opt_ns = t_work + c  # synchronous: votes / gradient gathers before NS
        else:
            t_opt_ns = max(c, t_work) + min(c, t_work) / layers
        exposed["step"] = t_opt_ns - t_work
        if t_tp:
            comm["tensor_parallel"] = exposed["tensor_parallel"] = t_tp
        t_opt = t_opt_ns + t_adam
        step = t_fb + t_copies + exposed["forward"] + exposed["backward"] + t_opt
        owns = mode in (*OWNER_MODES, "replicated", "sharded")
        # owner mode's scalar layout (memory.py): FSDP2's, all-reduced, or owned
        scalar_layout = {"owner-ddp": "all_reduce", "owner-ddp-zero1": "owner"}.get(mode, "sharded")
        out[mode] = ModePrediction(
            mode=mode,
            fwd_bwd_s=t_fb,
            ns_s=t_ns,
            adamw_s=t_adam,
            comm_s=comm,
            exposed_s=exposed,
            optimizer_s=t_opt,
            step_s=step,
            ns_flops_max=f_max,
            ns_flops_mean=f_mean,
            bytes_dmuon=sum(max(t.sent) for t in dm),
            bytes_framework=sum(max(t.sent) for t in fw),
            memory=memory_per_rank(
                local,
                mode_plan,
                "owner" if scalar_layout != "sharded" else mode,
                scalars=scalar_layout,
                held=held_numel if owns else None,
                experts=experts_local,
                replicas=lay.replicas,
                gathered=max((i.numel for i in spec.matrices if i.name in lay.splits), default=0)
                if mode in ("vanilla", "vanilla-ddp")
                else 0,
                rule=shape.rule,
                state_dtype=shape.state_dtype,
            ),
            transfers=transfers,
            tp_s=t_tp,
            bytes_tp=sum(max(t.sent) for t in tp_moved),
            copies_s=t_copies,
        )
    # owner mode's work per rank, in the engine's calls (the report's owner plan line)
    owner_loads = tuple(
        ns + tp + per_matrix * sum(i.batch for i in (*plan.items_of(r), *held[r]))
        for r, (ns, tp) in enumerate(
            unit_work(calls, cost, pricer=pricer) for calls in calls_of("owner")
        )
    )
    base, vanilla = out["adamw"].step_s, out["vanilla"].step_s
    for m in out.values():
        m.overhead_vs_adamw = m.step_s / base - 1
        m.speedup_vs_vanilla = vanilla / m.step_s
    return Prediction(
        spec,
        cluster,
        shape,
        plan,
        out,
        assumptions(spec, cluster, shape, lay, choices),
        lay,
        owner_loads,
    )


def assumptions(
    spec: ModelSpec,
    cluster: ClusterProfile,
    shape: TrainingShape,
    lay: Layout | None = None,
    choices: dict[str, SplitChoice] | None = None,
) -> list[tuple[str, str]]:
    """Every assumption the prediction rests on, with where it came from."""
    d = cluster.device

    def link(name: str, k: Link) -> str:
        return (
            f"{k.name}: {k.bandwidth:.3g} B/s × {k.efficiency:.2f}, "
            f"α {k.alpha * 1e6:.0f} µs ({k.source})"
        )

    measured = "ns_flops_per_second" in d.measured
    if shape.fwd_bwd_s is not None:
        fb = f"measured {shape.fwd_bwd_s * 1e3:.1f} ms (--fwd-bwd-ms)"
    else:
        fb = (
            f"6·{spec.active_params:,}·{shape.global_tokens:,} FLOPs / N at MFU "
            f"{shape.mfu:.2f} (Kaplan et al. 2020)"
        )
    rows = [
        ("model", f"{spec.name}: {spec.total_params:,} parameters ({spec.source})"),
        ("device", f"{d.name}: {d.peak_flops:.3g} FLOP/s, {d.memory_bandwidth:.3g} B/s "
         f"({d.source})"),
        ("NS kernel efficiency", f"{d.ns_efficiency:.2f} of peak "
         + ("(measured)" if measured else "(assumed; --calibrate measures it)")),
        ("memory efficiency", f"{d.memory_efficiency:.2f} of memory bandwidth"
         + (" (measured)" if measured else " (assumed)")),
        ("NS call overhead", f"{d.call_overhead * 1e6:.0f} µs per batched call (launches)"),
        ("optimizer overhead", f"{d.matrix_overhead * 1e6:.0f} µs per matrix stepped"
         + (" (measured)" if measured else " (not modelled for datasheet profiles)")),
        ("Sign-Muon overhead", f"{d.sign_overhead * 1e6:.0f} µs per matrix beyond Muon's "
         f"chain, {d.vote_overhead * 1e9:.2f} ns per element voted"
         + (" (measured)" if measured else " (not modelled for datasheet profiles)")),
        ("framework copies", "FSDP2 copies 2·B·(1 + 1/N) bytes in and out around each "
         "collective, at the memory rate; DDP's bucket copies are not charged"),
        ("overlap", "communication hides behind compute as the engine schedules it"
         if d.overlap else "none: the profile says communication and compute share the "
         "cores (a CPU)"),
        ("intra-node link", link("intra", cluster.intra)),
        ("inter-node link", link("inter", cluster.inter)),
        ("forward + backward", fb),
        ("Newton–Schulz", f"{shape.method}, {shape.ns_steps} steps, restarts "
         f"{list(shape.restarts)}; FLOPs by dmuon.kernels.ns_flops"),
        ("owner plan", "dmuon.comm.plan_owners (LPT) with NSCost at the profile's rates; "
         "NS time in the engine's calls: same-shape matrices batched within a step unit, "
         + ("no cap per call (a GPU's)" if batch_elements(cluster) >= 1 << 62 else
            f"≤ {batch_elements(cluster):,} entries per call (a CPU's)")),
        ("bytes", "DMuon: the wrappers' CommStats formulas (tested on gloo ranks); "
         "FSDP2/DDP: ring formulas of dmuon.comm.cost_model"),
        ("baselines", "AdamW = FSDP2 (ZeRO-3) + AdamW; vanilla = FSDP2 + Muon gathering every "
         "gradient and orthogonalising every matrix on every rank"),
        ("precision", f"parameters, gradients and traffic in {spec.matrices[0].dtype}; AdamW "
         f"moments fp32; the state rule {shape.rule!r} declares, in "
         f"{shape.state_dtype or 'the parameter dtype'}"),
        ("not modelled", "activations memory, stragglers, kernel-launch jitter; "
         "a group spanning nodes runs entirely at the inter-node link"),
    ]  # fmt: skip
    if lay is None or (lay.tp == 1 and lay.ep == 1):
        return rows
    rows[-1] = (
        "not modelled",
        "activations memory and their tensor-parallel collectives in forward/backward "
        "(inside the stated MFU), expert dispatch all-to-alls, stragglers, kernel-launch "
        "jitter; a group spanning nodes runs entirely at the inter-node link",
    )
    if lay.tp > 1:
        paths = [c.path for c in (choices or {}).values()]
        tp_link = cluster.link(lay.tp)
        rows.append(("tensor parallelism", (
            f"dp {lay.dp} × tp {lay.tp}, tp innermost ({tp_link.name} link); "
            f"{len(lay.splits)} matrices split (q/k/v, gate/up by rows; o, down by columns), "
            "embeddings, head, routers and experts whole; owners planned over dp by whole "
            "shapes, dp traffic carries shards; every gradient arrives laid out as its "
            "parameter (no sequence parallelism): no pending sums over tp "
            "(tensor_parallel_pending_sum) are predicted")))  # fmt: skip
        rows.append(("tensor-parallel path", (
            f"{paths.count('gram')} Gram, {paths.count('gather')} gather "
            f"(--tp-path {shape.tp_path}: dmuon.comm.tensor_parallel_path at the profile's "
            "NS rate and the tp link); the tp collectives are synchronous with NS")))  # fmt: skip
        rows.append(("baselines with tp", (
            "AdamW = FSDP2 over dp on 1/T shards; vanilla = the same, and every rank "
            "all-gathers every split matrix over tp and orthogonalises it whole")))  # fmt: skip
    if lay.ep > 1:
        rows.append(("expert parallelism", (
            f"ep {lay.ep}: {spec.experts // lay.ep} experts per stack per rank, "
            f"stepped where they live as one batch; {lay.replicas} replica(s) of each: "
            + ("no dp traffic for experts" if lay.replicas == 1 else
               "each expert reduced to an owner among its replicas and broadcast back")
            + "; dense matrices planned around each rank's experts "
            "(dmuon.comm.plan_owners(held=...)); FSDP2 collectives of expert stacks "
            "priced over the whole dp group")))  # fmt: skip
    rows.append(("engine support", (
        "tensor parallelism runs today in single, replicated, sharded and owner mode "
        "(dedicate over dp × tp); experts in single mode, in replicated mode over dp "
        "(all-reduced, then one owner among the replicas) and in sharded mode (stepped "
        "where they are), and in owner mode (ddp/fsdp.dedicate: each rank its own experts, one "
        "owner among the replicas); sign mode with either is predicted as designed "
        "(docs: Tensor and expert parallelism)")))  # fmt: skip
    return rows
