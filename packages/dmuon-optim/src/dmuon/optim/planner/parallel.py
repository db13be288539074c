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
orthogonalises each batched call of split matrices together by the path the engine's
``tp_path="auto"`` takes for that call (:func:`engine_tp_path`: the cheaper of the
Gram path and gather + Newton–Schulz by :func:`dmuon.comm.tensor_parallel_path` with
the call's batch, at the function's default rates, as the engine calls it), priced at
the profile's sustained rate and the tp group's link (:func:`price_split_call`,
:class:`SplitPricer`; :func:`tp_choices`: each matrix alone).

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
from dataclasses import dataclass, field, replace

from dmuon.comm import (
    MatrixItem,
    NSCost,
    OwnerPlan,
    gram_restarts,
    plan_owners,
    tensor_parallel_path,
)
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
    "SplitPricer",
    "chain_element_size",
    "engine_tp_path",
    "expert_transfers",
    "layout",
    "price_split_call",
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


def engine_tp_path(
    m: int,
    n: int,
    split_dim: int,
    world_size: int,
    *,
    batch: int,
    gram_element_size: int,
    gather_element_size: int,
    method: str,
    steps: int,
) -> str:
    """The path the engine's ``tp_path="auto"`` takes for one batched call of ``batch``
    split ``m × n`` matrices: :func:`dmuon.comm.tensor_parallel_path` called with the
    arguments :meth:`dmuon.optim.transforms.StepContext._gathers` passes it — the call's
    batch (every matrix of the call, ``batch_runs``' cut), the Gram matrices in the
    Newton–Schulz compute dtype, the shards in the chain's dtype, and the function's own
    default rates (``NSCost``'s FLOP rate, ``cost_model``'s α and bandwidth: the engine
    knows no device profile). The engine decides per call, so a matrix alone and the
    same matrix batched with others may take different paths.

    Examples:
        >>> engine_tp_path(4096, 1024, -2, 4, batch=1, gram_element_size=2,
        ...                gather_element_size=2, method="gram", steps=5)
        'gram'
    """
    return tensor_parallel_path(
        m,
        n,
        split_dim,
        world_size,
        gram_element_size=gram_element_size,
        gather_element_size=gather_element_size,
        batch=batch,
        method=method,
        steps=steps,
    ).path


def price_split_call(
    m: int,
    n: int,
    split_dim: int,
    world_size: int,
    cluster: ClusterProfile,
    *,
    batch: int = 1,
    method: str = "gram",
    steps: int = 5,
    tp_path: str = "auto",
    gram_element_size: int = GPU_GRAM_ELEMENT_SIZE,
    gather_element_size: int = 2,
) -> SplitChoice:
    """One batched call of ``batch`` split ``m × n`` matrices as the engine runs it: the
    path by :func:`engine_tp_path` (or ``tp_path`` forced), priced by
    :func:`dmuon.comm.tensor_parallel_path` with the same ``batch`` at the profile's
    sustained Newton–Schulz rate and the tp group's link: its collectives once for the
    call (the Gram matrices' all-reduces carry ``batch`` Gram matrices, the
    normalisation's ``batch`` maxima and ``batch + 1`` norms; the gather one all-gather
    of every shard), its FLOPs the function's own count (its price at 1 FLOP/s over a
    free link).

    Examples:
        >>> from dmuon.optim.planner.profiles import DEVICES, INTERCONNECTS, ClusterProfile
        >>> c = ClusterProfile(DEVICES["H100"], 8, 8, INTERCONNECTS["nvlink4"],
        ...                    INTERCONNECTS["ib-ndr"])
        >>> one = price_split_call(4096, 1024, -2, 8, c)  # an MLP up-projection alone
        >>> two = price_split_call(4096, 1024, -2, 8, c, batch=2)  # gate and up together
        >>> one.path, two.path  # the engine gathers one alone, Gram-reduces the two
        ('gather', 'gram')
        >>> three = price_split_call(4096, 1024, -2, 8, c, batch=3, tp_path="gram")
        >>> round(three.latency / two.latency, 9)  # the collectives once a call
        1.0
    """
    if tp_path not in ("auto", "gram", "gather"):
        raise ValueError(f"tp_path (--tp-path) must be auto, gram or gather, got {tp_path!r}")
    link = cluster.link(world_size)
    rate = cluster.device.ns_flops_per_second
    common = dict(
        gram_element_size=gram_element_size,
        gather_element_size=gather_element_size,
        batch=batch,
        method=method,
        steps=steps,
    )
    priced, counted, unlatent = (
        tensor_parallel_path(m, n, split_dim, world_size, **common, **rates)  # type: ignore[arg-type]
        for rates in (
            dict(flops_per_second=rate, alpha=link.alpha, bandwidth=link.effective_bandwidth),
            dict(flops_per_second=1.0, alpha=0.0, bandwidth=math.inf),
            # the same over a link without latency: the difference is the latency alone
            dict(flops_per_second=rate, alpha=0.0, bandwidth=link.effective_bandwidth),
        )
    )
    if tp_path == "auto":
        path = engine_tp_path(m, n, split_dim, world_size, **common)  # type: ignore[arg-type]
    else:
        path = tp_path
    if path == "gram":
        seconds, flops, sent = priced.gram_seconds, counted.gram_seconds, priced.gram_bytes
        latency = priced.gram_seconds - unlatent.gram_seconds
    else:
        seconds, flops = priced.gather_seconds, counted.gather_seconds
        sent = priced.gather_bytes
        latency = priced.gather_seconds - unlatent.gather_seconds
    return SplitChoice(path, seconds, flops, sent, seconds - flops / rate, latency)


def chain_element_size(item: MatrixItem, state_dtype: str | None) -> int:
    """Bytes per element of the rule's chain on ``item``: the parameter's, or at least
    fp32 under ``state_dtype`` (DMuon's ``state_dtype``: the chain then runs widened)."""
    return item.element_size if state_dtype is None else max(item.element_size, 4)


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
    """The path of every split matrix stepped alone (a call of its own ``batch``;
    :func:`price_split_call`: ``tp_path="auto"`` the engine's choice,
    :func:`engine_tp_path`; ``"gram"``/``"gather"`` forced), with its seconds, FLOPs and
    bytes. :func:`~dmuon.optim.planner.step_model.predict` prices the calls the engine
    batches instead (:class:`SplitPricer`); this is a matrix alone.

    Each path is priced in the bytes it sends: the Gram matrices in the Newton–Schulz
    compute dtype (``gram_element_size``, default :data:`GPU_GRAM_ELEMENT_SIZE`), the
    gathered shards in the dtype of the rule's chain (:func:`chain_element_size`).
    """
    if tp_path not in ("auto", "gram", "gather"):
        raise ValueError(f"tp_path (--tp-path) must be auto, gram or gather, got {tp_path!r}")
    if lay.tp == 1:
        return {}
    pricer = SplitPricer(lay, cluster, method, steps, tp_path, state_dtype, gram_element_size)
    return {item.name: pricer([item]) for item in spec.matrices if item.name in lay.splits}


@dataclass
class SplitPricer:
    """Prices the batched rule calls of split matrices as the engine runs them
    (:func:`price_split_call` on the call's whole shape, split and total batch), each
    distinct call once.

    Attributes:
        lay: the layout (which matrices split, and along which dimension; ``tp``).
        cluster: the profile whose rates price the chosen path.
        method: Newton–Schulz method.
        steps: Newton–Schulz steps.
        tp_path: ``"auto"`` (the engine's choice per call), ``"gram"`` or ``"gather"``.
        state_dtype: DMuon's ``state_dtype`` (the chain's dtype, which the gather sends).
        gram_element_size: bytes per element of the Gram matrices.
    """

    lay: Layout
    cluster: ClusterProfile
    method: str
    steps: int
    tp_path: str = "auto"
    state_dtype: str | None = None
    gram_element_size: int = GPU_GRAM_ELEMENT_SIZE
    _cache: dict[tuple[int, ...], SplitChoice] = field(default_factory=dict, repr=False)

    def __call__(self, call: Sequence[MatrixItem]) -> SplitChoice:
        """The price of one call of split matrices (all of one whole shape and split, as
        :func:`dmuon.optim.batch_layout.build_buckets` buckets them).

        Raises:
            ValueError: an empty call, a matrix that is not split, or a call that mixes
                shapes or splits (the engine never batches those together).
        """
        if not call:
            raise ValueError("a split call holds at least one matrix")
        first = call[0]
        keys = {(i.rows, i.cols, self.lay.splits.get(i.name)) for i in call}
        if len(keys) != 1 or first.name not in self.lay.splits:
            raise ValueError(
                f"a call of split matrices holds one whole shape and split, got {sorted(keys)} "
                f"for {[i.name for i in call]}"
            )
        m, n, dim = next(iter(keys))
        assert dim is not None
        batch = sum(i.batch for i in call)
        chain = chain_element_size(first, self.state_dtype)
        key = (m, n, dim, batch, chain)
        if key not in self._cache:
            self._cache[key] = price_split_call(
                m,
                n,
                dim,
                self.lay.tp,
                self.cluster,
                batch=batch,
                method=self.method,
                steps=self.steps,
                tp_path=self.tp_path,
                gram_element_size=self.gram_element_size,
                gather_element_size=chain,
            )
        return self._cache[key]


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
    *,
    calls: Sequence[Sequence[Sequence[MatrixItem]]] | None = None,
    pricer: SplitPricer | None = None,
) -> list[Transfer]:
    """The tp collectives of each dp rank's tp row (every rank of the row alike), as the
    engine's ``CommStats`` names them; their time is in ``tp_s``, not in a phase.

    With ``calls`` (each dp rank's batched rule calls,
    :func:`~dmuon.optim.planner.rule_calls.rule_calls`) and ``pricer``, each call of
    split matrices is priced as the engine runs it, its collectives once for the whole
    batch (:class:`SplitPricer`); without them, each matrix by its ``choices`` entry,
    alone."""
    if mode in ("adamw", "adamw-ddp", "vanilla", "vanilla-ddp"):
        return []
    out = []
    for path, op, collective in (
        ("gram", STATS_NAME, "all_reduce"),
        ("gather", GATHER_STATS_NAME, "all_gather"),
    ):
        t = Transfer(op, collective, "step", [0.0] * dp, [0.0] * dp, inside_ns=True)
        for r in range(dp):
            if calls is not None and pricer is not None:
                for call in calls[r]:
                    split = [i for i in call if i.name in pricer.lay.splits]
                    if not split:
                        continue
                    c = pricer(split)
                    if c.path == path:
                        t.sent[r] += c.bytes_sent
                        t.received[r] += c.bytes_sent
                        if r == 0:
                            t.collectives += _collectives_of(split[0], pricer, path)
                continue
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


def _collectives_of(item: MatrixItem, pricer: SplitPricer, path: str) -> int:
    """Collectives one call issues on ``path``: the gather's one all-gather; the Gram
    path's all-reduce of the Gram matrices at the start and at each restart
    (:func:`dmuon.comm.gram_restarts`) and the normalisation's two."""
    if path == "gather":
        return 1
    dim = pricer.lay.splits[item.name]
    return 1 + len(gram_restarts(item.rows, item.cols, dim, pricer.steps)) + 2


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
