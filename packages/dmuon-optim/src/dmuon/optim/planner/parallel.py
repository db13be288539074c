"""Tensor and expert parallelism in the planner: what each rank holds, steps and sends.

**Tensor parallelism** (``--tp T``) on a ``dp × tp`` mesh with ``tp`` innermost
(consecutive ranks, inside a node when ``T ≤ gpus_per_node``), ``dp = N/T``, as
torchtitan and Megatron lay a transformer out: attention ``q``/``k``/``v`` and the
MLP's ``gate``/``up`` split by output rows (``ColwiseParallel``), ``o`` and ``down``
by input columns (``RowwiseParallel``); GPT-2's ``Conv1D`` weights, stored
``(in, out)``, the other way round. Embeddings, the head, norms and biases (the
scalar optimizer's parameters), routers and expert stacks stay whole on every tp rank
(:func:`tp_split_dim`). A split ``m × n`` matrix is ``⌈L/T⌉ × g`` per rank (``L``
the split side, ``g`` the other).

Owners are planned over ``dp`` by whole shapes, so every tp column plans the same
owners, and what travels over ``dp`` is each rank's shard. The owner's tp row
orthogonalises a split matrix together by the cheaper of the Gram path and
gather + Newton–Schulz, as :func:`dmuon.comm.tensor_parallel_path` prices them at the
profile's sustained rate and the tp group's link (the function the engine's
``tp_path="auto"`` calls); :func:`tp_choices` keeps its seconds, bytes and FLOPs.

**Expert parallelism** (``--ep E_p``) splits every expert stack ``(E, m, n)`` over
``E_p`` ranks of ``dp`` (``E_p | E``, ``E_p | dp``): each rank holds ``E/E_p`` experts of
every stack and orthogonalises them where they live, as one batch. The ``R = dp/E_p``
ranks holding the same experts (their replicas) reduce each expert's gradient to
one owner among them and broadcast it back, like owner mode within the replicas
(no dp traffic when ``R = 1``). Each rank's experts are handed to
:func:`dmuon.comm.plan_owners` as ``held`` load, so the dense matrices are balanced
around them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dmuon.comm import MatrixItem, NSCost, OwnerPlan, plan_owners, tensor_parallel_path
from dmuon.kernels import default_compute_dtype, ns_flops
from dmuon.optim.engine.tensor_split import GATHER_STATS_NAME, STATS_NAME
from dmuon.optim.planner.config import ModelSpec
from dmuon.optim.planner.profiles import ClusterProfile
from dmuon.optim.planner.traffic import Transfer, dmuon_transfers, ring_transfer

GPU_GRAM_ELEMENT_SIZE = default_compute_dtype("cuda", "gram").itemsize
"""Bytes per element of the Gram matrices the tensor-parallel Gram path all-reduces on a
GPU: the default compute dtype of Gram Newton–Schulz there is fp16
(:func:`dmuon.kernels.default_compute_dtype`)."""

NS_COMPUTE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
"""Bytes per element of each Newton–Schulz compute dtype the planner takes
(``--ns-compute-dtype``): what the Gram path's all-reduces send per element."""

__all__ = [
    "GPU_GRAM_ELEMENT_SIZE",
    "NS_COMPUTE_BYTES",
    "Layout",
    "SplitChoice",
    "expert_transfers",
    "layout",
    "rank_work",
    "tp_choices",
    "tp_split_dim",
    "tp_transfers",
    "vanilla_tp_gather",
]

# (pattern on the parameter name, dimension of the stored weight that tensor
# parallelism splits): nn.Linear stores (out, in), so colwise splits rows (-2) and
# rowwise columns (-1); GPT-2's Conv1D stores (in, out), the other way round.
_TP_STYLES: tuple[tuple[re.Pattern[str], int], ...] = tuple(
    (re.compile(p), d)
    for p, d in (
        (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", -2),  # HF Llama-like
        (r"\.(o_proj|down_proj)\.weight$", -1),
        (r"\.attn\.c_attn\.weight$|\.mlp\.c_fc\.weight$", -1),  # GPT-2 Conv1D (in, out)
        (r"\.attn\.c_proj\.weight$|\.mlp\.c_proj\.weight$", -2),
        (r"\.attn\.(q|k|v)\.weight$|\.mlp\.fc\.weight$", -2),  # benchmarks' GPT
        (r"\.attn\.proj\.weight$|\.mlp\.proj\.weight$", -1),
    )
)


def tp_split_dim(item: MatrixItem) -> int | None:
    """The dimension tensor parallelism splits ``item`` along (``-2`` rows, ``-1``
    columns), or ``None`` for a matrix left whole (routers, expert stacks, anything
    not named as an attention or MLP projection).

    Examples:
        >>> from dmuon.comm import MatrixItem
        >>> tp_split_dim(MatrixItem("model.layers.0.self_attn.q_proj.weight", (4096, 4096)))
        -2
        >>> tp_split_dim(MatrixItem("model.layers.0.mlp.down_proj.weight", (4096, 14336)))
        -1
        >>> tp_split_dim(MatrixItem("model.layers.0.mlp.gate.weight", (8, 4096))) is None
        True
    """
    if len(item.shape) != 2:
        return None
    for pattern, dim in _TP_STYLES:
        if pattern.search(item.name):
            return dim
    return None


@dataclass(frozen=True)
class Layout:
    """A model laid out on ``N = dp × tp`` ranks with ``ep`` expert groups inside ``dp``.

    Attributes:
        tp: tensor-parallel degree ``T``.
        ep: expert-parallel degree ``E_p``.
        dp: data-parallel ranks ``N/T``.
        replicas: ranks of ``dp`` holding the same experts, ``R = dp/E_p``.
        splits: name → split dimension of every tensor-parallel matrix.
        dense: the matrices the owner plan places (every matrix but the expert stacks
            when ``ep > 1``), whole shapes.
        local: the spec as one rank holds it: split matrices as their shard
            (``⌈L/T⌉ × g``), expert stacks as ``E/E_p`` experts.
        held: per dp rank, the experts it steps outside the plan (``None`` when
            ``ep = 1``: the stacks are planned like any matrix).
        expert_plan: the owners of each rank's experts among its ``R`` replicas
            (``None`` when ``ep = 1``).
    """

    tp: int
    ep: int
    dp: int
    replicas: int
    splits: dict[str, int]
    dense: tuple[MatrixItem, ...]
    local: ModelSpec
    held: tuple[tuple[MatrixItem, ...], ...] | None
    expert_plan: OwnerPlan | None

    def shard_shape(self, item: MatrixItem) -> tuple[int, ...]:
        """What one tp rank holds of ``item`` (its whole shape when it is not split)."""
        dim = self.splits.get(item.name)
        if dim is None:
            return item.shape
        shape = list(item.shape)
        shape[dim] = -(-shape[dim] // self.tp)
        return tuple(shape)


def _check(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    return value


def layout(spec: ModelSpec, gpus: int, tp: int = 1, ep: int = 1, *, cost: NSCost) -> Layout:
    """Lay ``spec`` out on ``gpus`` ranks with tensor-parallel degree ``tp`` and
    expert-parallel degree ``ep``.

    Raises:
        ValueError: naming ``--tp``/``--ep`` and the value: ``tp`` not dividing
            ``gpus``; ``tp`` not dividing the attention or key/value heads (each rank
            holds whole heads); ``ep`` on a dense model, not dividing the experts per
            stack or the data-parallel ranks ``gpus/tp``.

    Examples:
        >>> from dmuon.comm import NSCost
        >>> from dmuon.optim.planner.config import load_model
        >>> lay = layout(load_model("llama-3.1-8b"), 64, tp=8, cost=NSCost())
        >>> lay.dp, lay.shard_shape(lay.dense[0])  # q_proj, split by rows
        (8, (512, 4096))
    """
    _check("--tp", tp)
    _check("--ep", ep)
    if gpus % tp:
        raise ValueError(f"--tp {tp} must divide --gpus {gpus} (dp = gpus / tp)")
    for what, count in (("attention heads", spec.heads), ("key/value heads", spec.kv_heads)):
        if tp > 1 and count and count % tp:
            raise ValueError(
                f"--tp {tp}: {spec.name} has {count} {what}, which {tp} ranks cannot split "
                f"into whole heads; use a --tp that divides {count}"
            )
    dp = gpus // tp
    experts = spec.experts
    if ep > 1:
        if not experts:
            raise ValueError(
                f"--ep {ep}: {spec.name} is a dense model (no expert stacks); use --ep 1"
            )
        if experts % ep:
            raise ValueError(
                f"--ep {ep} must divide the {experts} experts of each stack of {spec.name}"
            )
        if dp % ep:
            raise ValueError(
                f"--ep {ep} must divide the data-parallel ranks gpus/tp = {gpus}/{tp} = {dp}"
            )
    splits = {}
    if tp > 1:
        splits = {i.name: d for i in spec.matrices if (d := tp_split_dim(i)) is not None}
    is_expert = (lambda i: len(i.shape) > 2) if ep > 1 else (lambda i: False)
    dense = tuple(i for i in spec.matrices if not is_expert(i))
    replicas = dp // ep
    local_items = []
    for i in spec.matrices:
        if is_expert(i):
            local_items.append(replace(i, shape=(i.shape[0] // ep, *i.shape[1:])))
        elif i.name in splits:
            shape = list(i.shape)
            shape[splits[i.name]] = -(-shape[splits[i.name]] // tp)
            local_items.append(replace(i, shape=tuple(shape)))
        else:
            local_items.append(i)
    local = replace(spec, matrices=tuple(local_items))
    held: tuple[tuple[MatrixItem, ...], ...] | None = None
    expert_plan = None
    if ep > 1:
        expert_plan = _expert_owners(local, replicas, cost)
        # dp rank d = (replica d // ep, expert group d % ep); every group is alike, so a
        # rank's experts are its replica's share of its group's stacks, renamed per group
        held = tuple(
            tuple(replace(i, name=f"{i.name}@ep{d % ep}") for i in expert_plan.items_of(d // ep))
            for d in range(dp)
        )
    return Layout(tp, ep, dp, replicas, splits, dense, local, held, expert_plan)


def _expert_owners(local: ModelSpec, replicas: int, cost: NSCost) -> OwnerPlan:
    """The owner of each part of one rank's expert stacks among its ``R`` replicas: each
    stack of ``E/E_p`` experts is cut into ``R`` consecutive runs of experts (as even as
    the count allows) planned over the replicas; with ``R = 1`` the stacks stay whole."""
    parts: list[MatrixItem] = []
    for i in local.matrices:
        if len(i.shape) <= 2:
            continue
        k = i.shape[0]
        cuts = [k * j // replicas for j in range(replicas + 1)]
        for j in range(replicas):
            if cuts[j + 1] > cuts[j]:
                name = i.name if replicas == 1 else f"{i.name}[{cuts[j]}:{cuts[j + 1]}]"
                parts.append(replace(i, name=name, shape=(cuts[j + 1] - cuts[j], *i.shape[1:])))
    return plan_owners(parts, replicas, cost=cost, pack_below=0)


@dataclass(frozen=True)
class SplitChoice:
    """How the owner's tp row orthogonalises one split matrix, per rank of the row.

    Attributes:
        path: ``"gram"`` or ``"gather"``.
        seconds: predicted seconds (Newton–Schulz and the tp collectives).
        flops: Newton–Schulz FLOPs per rank on that path.
        bytes_sent: bytes each rank sends over ``tp``.
        comm_seconds: the part of ``seconds`` spent in the tp collectives.
        latency: the part of ``comm_seconds`` that is latency (``α`` per collective
            step): what a batch of same-shape split matrices pays once, since the
            engine issues each of the path's collectives once per batch
            (:func:`~dmuon.optim.planner.rule_calls.unit_work`).
    """

    path: str
    seconds: float
    flops: float
    bytes_sent: float
    comm_seconds: float
    latency: float = 0.0


def tp_choices(
    spec: ModelSpec,
    lay: Layout,
    cluster: ClusterProfile,
    *,
    method: str,
    steps: int,
    tp_path: str = "auto",
    state_dtype: str | None = None,
    gram_element_size: int = GPU_GRAM_ELEMENT_SIZE,
) -> dict[str, SplitChoice]:
    """The path of every split matrix (``tp_path="auto"``: the cheaper by
    :func:`dmuon.comm.tensor_parallel_path` at the profile's Newton–Schulz rate and the
    tp link; ``"gram"``/``"gather"`` forced), with its seconds, FLOPs and bytes.

    Each path is priced in the bytes it sends: the Gram matrices in the Newton–Schulz
    compute dtype (``gram_element_size``, default :data:`GPU_GRAM_ELEMENT_SIZE`), the
    gathered shards in the dtype of the rule's chain — the parameter's, or at least fp32
    under ``state_dtype`` (DMuon's ``state_dtype``: the chain then runs widened).

    The FLOPs of a path are the function's own price of it at 1 FLOP/s over a free link
    (``α = 0``, infinite bandwidth): the count it charges, not a second formula.
    """
    if tp_path not in ("auto", "gram", "gather"):
        raise ValueError(f"tp_path (--tp-path) must be auto, gram or gather, got {tp_path!r}")
    if lay.tp == 1:
        return {}
    link = cluster.link(lay.tp)
    rate = cluster.device.ns_flops_per_second
    out = {}
    for item in spec.matrices:
        dim = lay.splits.get(item.name)
        if dim is None:
            continue
        chain = item.element_size if state_dtype is None else max(item.element_size, 4)
        common = dict(
            gram_element_size=gram_element_size,
            gather_element_size=chain,
            batch=item.batch,
            method=method,
            steps=steps,
        )
        m, n = item.rows, item.cols
        priced = tensor_parallel_path(
            m,
            n,
            dim,
            lay.tp,
            flops_per_second=rate,
            alpha=link.alpha,
            bandwidth=link.effective_bandwidth,
            **common,  # type: ignore[arg-type]
        )
        counted = tensor_parallel_path(
            m,
            n,
            dim,
            lay.tp,
            flops_per_second=1.0,
            alpha=0.0,
            bandwidth=math.inf,
            **common,  # type: ignore[arg-type]
        )
        # the same over a link without latency: the difference is the latency alone
        unlatent = tensor_parallel_path(
            m,
            n,
            dim,
            lay.tp,
            flops_per_second=rate,
            alpha=0.0,
            bandwidth=link.effective_bandwidth,
            **common,  # type: ignore[arg-type]
        )
        path = priced.path if tp_path == "auto" else tp_path
        if path == "gram":
            seconds, flops, sent = priced.gram_seconds, counted.gram_seconds, priced.gram_bytes
            latency = priced.gram_seconds - unlatent.gram_seconds
        else:
            seconds, flops = priced.gather_seconds, counted.gather_seconds
            sent = priced.gather_bytes
            latency = priced.gather_seconds - unlatent.gather_seconds
        out[item.name] = SplitChoice(path, seconds, flops, sent, seconds - flops / rate, latency)
    return out


def rank_work(
    items: Sequence[MatrixItem],
    choices: dict[str, SplitChoice],
    cost: NSCost,
    *,
    method: str,
    steps: int,
    restarts: tuple[int, ...],
) -> tuple[float, float, float]:
    """(Newton–Schulz seconds, tp collective seconds, FLOPs) of stepping ``items`` on one
    rank: a split matrix by its tp path, any other alone at the profile's cost."""
    seconds = tp = split_flops = 0.0
    flops = 0  # exact integers while no split matrix is counted
    for i in items:
        c = choices.get(i.name)
        if c is not None:
            seconds += c.seconds - c.comm_seconds
            tp += c.comm_seconds
            split_flops += c.flops
        else:
            seconds += cost(i)
            flops += ns_flops(
                i.rows,
                i.cols,
                method=method,
                steps=steps,
                restarts=restarts,
                batch=i.batch,
            )
    return seconds, tp, (flops + split_flops if split_flops else flops)


def tp_transfers(
    choices: dict[str, SplitChoice],
    plan: OwnerPlan,
    held: Sequence[Sequence[MatrixItem]],
    mode: str,
    dp: int,
) -> list[Transfer]:
    """The tp collectives of each dp rank's tp row (every rank of the row alike), as the
    engine's ``CommStats`` names them; their time is in ``tp_s``, not in a phase."""
    if mode in ("adamw", "adamw-ddp", "vanilla", "vanilla-ddp"):
        return []
    out = []
    for path, op, collective in (
        ("gram", STATS_NAME, "all_reduce"),
        ("gather", GATHER_STATS_NAME, "all_gather"),
    ):
        t = Transfer(op, collective, "step", [0.0] * dp, [0.0] * dp, inside_ns=True)
        for r in range(dp):
            mine = (
                list(choices.values())
                if mode == "sign"
                else [choices[i.name] for i in (*plan.items_of(r), *held[r]) if i.name in choices]
            )
            for c in mine:
                if c.path == path:
                    t.sent[r] += c.bytes_sent
                    t.received[r] += c.bytes_sent
                    t.collectives += r == 0
        if any(t.sent):
            out.append(t)
    return out


def vanilla_tp_gather(spec: ModelSpec, lay: Layout, layers: int) -> Transfer:
    """Vanilla Muon on a tensor-parallel model: every rank all-gathers every split
    gradient over ``tp`` and orthogonalises the whole matrix."""
    nbytes = sum(i.nbytes for i in spec.matrices if i.name in lay.splits)
    return ring_transfer("tp_gather_gradients", "all_gather", "step", nbytes, lay.tp, layers)


def expert_transfers(lay: Layout, mode: str) -> list[Transfer]:
    """The experts' reduce to their owner among the ``R`` replicas and the broadcast back
    (owner mode's collectives over the replica group, whatever the dense mode)."""
    assert lay.expert_plan is not None
    experts = replace(lay.local, matrices=lay.expert_plan.items, scalars=())
    out = dmuon_transfers(experts, lay.expert_plan, "owner-z3" if mode == "owner-z3" else "owner")
    for t in out:
        t.op = f"{t.op}[experts]"
        t.stride = lay.ep  # the replicas of an expert group are ep dp ranks apart
    return out
