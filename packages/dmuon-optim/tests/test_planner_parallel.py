"""Tensor and expert parallelism in the planner: layout, FLOPs, bytes, memory, refusals."""

import math

import pytest

from dmuon.comm import NSCost, ns_flops, plan_owners, tensor_parallel_path
from dmuon.optim.planner.config import load_model
from dmuon.optim.planner.memory import memory_per_rank
from dmuon.optim.planner.parallel import layout, tp_split_dim
from dmuon.optim.planner.profiles import DEVICES, INTERCONNECTS, ClusterProfile
from dmuon.optim.planner.rule_calls import rule_calls, unit_work
from dmuon.optim.planner.step_model import TrainingShape, ns_cost, predict
from dmuon.optim.planner.traffic import dmuon_transfers, framework_transfers, step_units

MODES = ("owner", "owner-z3", "replicated", "sharded", "sign")


def cluster(n, per_node=8):
    return ClusterProfile(DEVICES["H100"], n, per_node, INTERCONNECTS["nvlink4"],
                          INTERCONNECTS["ib-ndr"])  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    return load_model("llama-3.2-3b")  # 24 heads, 8 key/value heads: tp 2, 4, 8 split them


@pytest.fixture(scope="module")
def moe():
    return load_model("qwen1.5-moe-a2.7b")  # 60 experts per stack, shared experts, 16 heads


def test_tp_1_and_ep_1_change_nothing(llama):
    shape = TrainingShape(global_tokens=2**20)
    plain = predict(llama, cluster(16), shape, modes=MODES)
    lay = plain.layout
    assert lay.local == llama and lay.dense == llama.matrices and lay.held is None
    assert plain.plan.owners == plan_owners(llama.matrices, 16, cost=NSCost(
        flops_per_second=DEVICES["H100"].ns_flops_per_second,
        bytes_per_second=DEVICES["H100"].bytes_per_second,
        call_overhead=DEVICES["H100"].call_overhead)).owners  # fmt: skip
    for m in plain.modes.values():
        assert m.tp_s == 0 and m.bytes_tp == 0
        assert all(not t.inside_ns and t.stride == 1 for t in m.transfers)
    # the data-parallel terms, each from the function that computes it alone
    cost = ns_cost(cluster(16), shape)
    for mode in ("owner", "owner-z3", "replicated", "sharded"):
        m = plain.modes[mode]
        # Newton–Schulz as the engine batches it: per step unit (rule_calls.py), not by
        # the plan's loads, which batch a rank's same-shape matrices across layers
        units = step_units(llama, plain.plan, mode)
        ranks = [rule_calls(plain.plan.items_of(r), units, batch_limit=1 << 62) for r in range(16)]
        assert m.ns_s == max(unit_work(calls, cost)[0] for calls in ranks)
        assert m.ns_s > plain.plan.max_load  # more calls than the loads count
        assert m.bytes_dmuon == sum(max(t.sent) for t in dmuon_transfers(llama, plain.plan, mode))
        assert m.bytes_framework == sum(max(t.sent) for t in framework_transfers(llama, mode, 16))
        assert m.memory == memory_per_rank(llama, plain.plan, mode)
    # a forced tp path is moot without tensor parallelism: the same prediction
    forced = predict(llama, cluster(16), TrainingShape(global_tokens=2**20, tp_path="gram"),
                     modes=MODES)  # fmt: skip
    for k, m in plain.modes.items():
        assert forced.modes[k].as_dict() == m.as_dict(), k


def test_colwise_and_rowwise_split_the_right_dimension(llama):
    q, k, v, o, gate, up, down = llama.matrices[:7]
    assert [tp_split_dim(i) for i in (q, k, v, gate, up)] == [-2] * 5  # output rows
    assert [tp_split_dim(i) for i in (o, down)] == [-1, -1]  # input columns
    gpt2 = load_model("gpt2")  # Conv1D stores (in, out): the other way round
    assert [tp_split_dim(i) for i in gpt2.matrices[:4]] == [-1, -2, -1, -2]
    mixtral = load_model("mixtral-8x7b")
    router, *stacks = [i for i in mixtral.matrices if ".block_sparse_moe." in i.name][:4]
    assert tp_split_dim(router) is None and all(tp_split_dim(s) is None for s in stacks)


def test_split_matrices_memory_divides_by_tp(llama):
    e = llama.matrices[0].dtype.itemsize
    dp = 4
    for T in (1, 2, 4, 8):
        p = predict(llama, cluster(dp * T), TrainingShape(global_tokens=2**20, tp=T),
                    modes=("owner", "sharded"))  # fmt: skip
        local = p.layout.local
        # every Llama matrix is split and every split side divides: exactly 1/T per rank
        assert local.matrix_params * T == llama.matrix_params
        assert local.scalar_params == llama.scalar_params  # embeddings, head, norms whole
        owner = p.modes["owner"].memory
        assert owner["weights"] == pytest.approx(
            llama.matrix_params * e / T + llama.scalar_params * e / dp
        )
        owned = max(sum(i.numel for i in p.plan.items_of(r)) for r in range(dp))
        assert owner["optimizer_state"] == pytest.approx(
            owned * e / T + 8 * llama.scalar_params / dp
        )
        adamw = p.modes["adamw"].memory
        assert adamw["optimizer_state"] == pytest.approx(8 * local.total_params / dp)


def test_more_tp_never_increases_per_rank_newton_schulz_flops(llama):
    # the same dp owners (dp 4), tp 1 → 8: each owner's tp row shares its matrices
    last = {m: math.inf for m in MODES}
    for T in (1, 2, 4, 8):
        p = predict(llama, cluster(4 * T), TrainingShape(global_tokens=2**20, tp=T),
                    modes=MODES)  # fmt: skip
        for m in MODES:
            f = p.modes[m].ns_flops_max
            assert f <= last[m], (m, T, f, last[m])
            last[m] = f
        # vanilla gathers every split matrix and orthogonalises it whole, whatever T
        whole = sum(ns_flops(i.rows, i.cols, batch=i.batch) for i in llama.matrices)
        assert p.modes["vanilla"].ns_flops_max == whole


def test_tp_flops_and_bytes_are_those_of_tensor_parallel_path(llama):
    T, dp = 4, 2
    c = cluster(dp * T)
    p = predict(llama, c, TrainingShape(global_tokens=2**20, tp=T), modes=("owner",))
    link, rate = c.link(T), DEVICES["H100"].ns_flops_per_second
    want_flops = [0.0] * dp
    want_bytes = [0.0] * dp
    for r in range(dp):
        for i in p.plan.items_of(r):
            dim = tp_split_dim(i)
            choice = tensor_parallel_path(
                i.rows,
                i.cols,
                dim,
                T,
                element_size=i.element_size,
                flops_per_second=rate,
                alpha=link.alpha,
                bandwidth=link.effective_bandwidth,
            )
            want_bytes[r] += choice.gram_bytes if choice.path == "gram" else choice.gather_bytes
            if choice.path == "gather":  # the whole matrix on every rank of the row
                want_flops[r] += ns_flops(i.rows, i.cols)
            else:  # Gram path: the closed form of its docstring, restated here as reference
                g, split = (i.cols, i.rows) if dim == -2 else (i.rows, i.cols)
                r_ = 1 if g <= split else 4
                want_flops[r] += 4 * (1 + r_) * g * g * -(-split // T) + (8 * 5 - 6 - 6 * r_) * g**3
    owner = p.modes["owner"]
    assert owner.ns_flops_max == pytest.approx(max(want_flops), rel=1e-12)
    assert owner.bytes_tp == pytest.approx(max(want_bytes), rel=1e-12)
    tp = [t for t in owner.transfers if t.inside_ns]
    assert {t.op for t in tp} <= {"tensor_parallel_reduce", "tensor_parallel_gather"}
    assert [sum(t.sent[r] for t in tp) for r in range(dp)] == pytest.approx(want_bytes)


def test_tp_collectives_pay_their_latency_once_per_batch(llama):
    # dp 1 × tp 4: the one owner row steps every matrix; each layer's k and v (and its
    # gate and up) share a shape and a split, so the engine runs them as one batch and
    # issues each collective of its tp path once (tensor_parallel_path with batch=2)
    T = 4
    c = cluster(T)
    p = predict(llama, c, TrainingShape(global_tokens=2**20, tp=T), modes=("owner",))
    link, rate = c.link(T), DEVICES["H100"].ns_flops_per_second
    batches = {}
    for i in llama.matrices:
        batches.setdefault((i.layer, i.shape, tp_split_dim(i)), []).append(i)
    assert sorted({len(b) for b in batches.values()}) == [1, 2]
    want = 0.0
    for (_, (m, n), dim), items in batches.items():
        e = items[0].element_size
        on = dict(flops_per_second=rate, alpha=link.alpha, bandwidth=link.effective_bandwidth)
        free = dict(flops_per_second=rate, alpha=0.0, bandwidth=math.inf)
        alone = tensor_parallel_path(m, n, dim, T, element_size=e, gram_element_size=2, **on)
        priced, unpriced = (
            tensor_parallel_path(
                m, n, dim, T, element_size=e, gram_element_size=2, batch=len(items), **kw
            )
            for kw in (on, free)
        )
        if alone.path == "gram":  # the path a matrix takes alone (the planner's choice)
            want += priced.gram_seconds - unpriced.gram_seconds
        else:
            want += priced.gather_seconds - unpriced.gather_seconds
    # the bytes stay per matrix (a batch's norms all-reduce carries 4 bytes fewer per
    # extra matrix than two matrices alone): 1e-6 covers that, not a latency
    assert p.modes["owner"].tp_s == pytest.approx(want, rel=1e-6)


def test_dp_traffic_carries_shards(llama):
    T, dp = 2, 4
    p = predict(llama, cluster(dp * T), TrainingShape(global_tokens=2**20, tp=T), modes=MODES)
    q = predict(llama, cluster(dp), TrainingShape(global_tokens=2**20), modes=MODES)
    assert p.plan.owners == q.plan.owners  # planned over dp by whole shapes
    for mode in ("owner", "owner-z3", "sharded"):  # every matrix's shard halves exactly
        assert p.modes[mode].bytes_dmuon == pytest.approx(
            q.modes[mode].bytes_dmuon / T, rel=1e-3
        ), mode
    # a dp group of 4 ranks 2 apart spans 8 ranks: one node of 8 here, two nodes of 4
    on_two = predict(llama, cluster(dp * T, per_node=4), TrainingShape(2**20, tp=T),
                     modes=("owner",))  # fmt: skip
    assert on_two.modes["owner"].comm_s["backward"] > p.modes["owner"].comm_s["backward"]


def test_experts_are_held_where_they_live_and_the_dense_plan_balances_around_them(moe):
    E = moe.experts
    assert E == 60
    for ep, gpus in ((4, 4), (4, 8), (2, 8)):
        p = predict(moe, cluster(gpus), TrainingShape(global_tokens=2**20, ep=ep), modes=MODES)
        lay = p.layout
        replicas = gpus // ep
        stacks = [i for i in moe.matrices if len(i.shape) > 2]
        assert all(len(i.shape) == 2 for i in p.plan.items)  # the stacks are not planned
        # every expert of every stack is stepped by exactly one rank
        held = [sum(i.batch for i in h) for h in lay.held]
        assert sum(held) == sum(i.batch for i in stacks)
        assert max(held) - min(held) <= len(stacks)  # ⌈⌉ vs ⌊⌋ of the runs
        # the plan's loads include the experts (plan_owners(held=...))
        assert p.plan.imbalance() < 0.05
        # Newton–Schulz FLOPs over all ranks: the dense matrices once, every expert once
        total = sum(ns_flops(i.rows, i.cols, batch=i.batch) for i in moe.matrices)
        assert p.modes["owner"].ns_flops_mean * gpus == pytest.approx(total, rel=1e-12)
        experts_moved = [t for t in p.modes["owner"].transfers if t.op.endswith("[experts]")]
        if replicas == 1:
            assert not experts_moved  # no dp traffic for experts held by one rank
        else:
            assert experts_moved and all(t.group_size == replicas for t in experts_moved)


def test_expert_memory_is_a_share_of_the_stacks(moe):
    e = moe.matrices[0].dtype.itemsize
    stacks = sum(i.numel for i in moe.matrices if len(i.shape) > 2)
    dense = moe.matrix_params - stacks
    ep, gpus = 4, 8
    p = predict(moe, cluster(gpus), TrainingShape(global_tokens=2**20, ep=ep), modes=("owner",))
    assert p.modes["owner"].memory["weights"] == pytest.approx(
        (dense + stacks / ep) * e + moe.scalar_params * e / gpus
    )
    # FSDP2 (AdamW) shards each rank's experts over their replicas: the stacks / gpus
    assert p.modes["adamw"].memory["optimizer_state"] == pytest.approx(
        8 * (dense + moe.scalar_params) / gpus + 8 * stacks / gpus
    )


@pytest.mark.parametrize(
    ("model", "gpus", "tp", "ep", "message"),
    [
        ("llama-3.2-3b", 12, 8, 1, "--tp 8 must divide --gpus 12"),
        ("llama-3.2-3b", 48, 3, 1, "--tp 3: llama-3.2-3b has 8 key/value heads"),
        ("llama-3.2-3b", 64, 16, 1, "--tp 16: llama-3.2-3b has 24 attention heads"),
        ("llama-3.2-3b", 8, 1, 2, "--ep 2: llama-3.2-3b is a dense model"),
        ("mixtral-8x7b", 24, 1, 3, "--ep 3 must divide the 8 experts"),
        ("mixtral-8x7b", 16, 4, 8, "--ep 8 must divide the data-parallel ranks"),
        ("mixtral-8x7b", 8, 1, 0, "--ep must be an integer ≥ 1, got 0"),
    ],
)
def test_bad_tp_or_ep_is_refused_naming_the_flag(model, gpus, tp, ep, message):
    spec = load_model(model)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        layout(spec, gpus, tp, ep, cost=NSCost())
