"""The step-time and memory model: FLOPs, bytes, limits and monotonicity."""

import pytest
import torch

from dmuon.comm import ns_flops as closed_form_ns_flops
from dmuon.comm import plan_owners
from dmuon.optim.planner.config import load_model
from dmuon.optim.planner.profiles import (
    DEVICES,
    INTERCONNECTS,
    ClusterProfile,
    DeviceProfile,
    Link,
    load_device_profile,
)
from dmuon.optim.planner.rule_calls import rule_calls, unit_work
from dmuon.optim.planner.step_model import ALL_MODES, TrainingShape, ns_cost, predict
from dmuon.optim.planner.traffic import dmuon_transfers, framework_transfers, step_units


def cluster(n, device="H100", per_node=8):
    return ClusterProfile(DEVICES[device], n, per_node, INTERCONNECTS["nvlink4"],
                          INTERCONNECTS["ib-ndr"])  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    return load_model("llama-3.2-3b")


def test_per_rank_flops_equal_the_closed_form_count(llama):
    shape = TrainingShape(global_tokens=2**20)
    p = predict(llama, cluster(16), shape, modes=("owner",))
    # reference: dmuon.comm's closed form (dmuon.kernels counts by walking the iteration)
    per_rank = [
        sum(closed_form_ns_flops(i.rows, i.cols, batch=i.batch) for i in p.plan.items_of(r))
        for r in range(16)
    ]
    assert p.modes["owner"].ns_flops_max == max(per_rank)
    assert p.modes["owner"].ns_flops_mean == pytest.approx(sum(per_rank) / 16)
    every = sum(closed_form_ns_flops(i.rows, i.cols, batch=i.batch) for i in llama.matrices)
    assert p.modes["vanilla"].ns_flops_max == every == sum(per_rank)


def test_owner_traffic_is_one_ring_all_reduce_and_z3_adds_a_broadcast(llama):
    P = sum(i.nbytes for i in llama.matrices)
    for n in (2, 3, 8, 128):
        plan = plan_owners(llama.matrices, n)
        z2 = dmuon_transfers(llama, plan, "owner")
        z3 = dmuon_transfers(llama, plan, "owner-z3")
        ring = 2 * (n - 1) / n * P
        assert z2[0].sent[0] + z2[1].sent[0] == pytest.approx(ring)
        assert sum(t.sent[0] for t in z3[:3]) == pytest.approx(1.5 * ring)


def test_sharded_moves_two_shard_volumes_and_sign_a_twentieth(llama):
    n = 8
    plan = plan_owners(llama.matrices, n)
    P = sum(i.nbytes for i in llama.matrices)
    there, back, _ = dmuon_transfers(llama, plan, "sharded")
    # every rank sends (N−1)/N of its shards when rows divide evenly (they do here)
    assert sum(there.sent) == pytest.approx((n - 1) / n * P)
    assert sum(there.sent) == pytest.approx(sum(back.received))
    vote = dmuon_transfers(llama, plan, "sign")[0]
    fp32_all_reduce = 2 * (n - 1) / n * sum(i.numel * 4 for i in llama.matrices)
    # five ternary votes per byte: 1.6 bits per entry against 32
    assert vote.sent[0] == pytest.approx(fp32_all_reduce / 20, rel=1e-3)


def test_more_gpus_never_increase_the_per_rank_newton_schulz_time(llama):
    shape = TrainingShape(global_tokens=2**22)
    previous = float("inf")
    for n in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 100, 128, 256, 512, 1024):
        p = predict(llama, cluster(n), shape, modes=("owner",))
        t = p.modes["owner"].ns_s
        assert t <= previous * (1 + 1e-12), f"{n} GPUs: {t} > {previous}"
        previous = t
    # with more ranks than matrices, no rank can finish before its largest matrix
    cost = ns_cost(cluster(1024), shape)
    assert previous >= max(cost(i) for i in llama.matrices) > 0


def test_one_gpu_vanilla_equals_every_dmuon_mode(llama):
    p = predict(llama, cluster(1), TrainingShape(global_tokens=2**16))
    vanilla = p.modes["vanilla"]
    cost = ns_cost(cluster(1), TrainingShape(global_tokens=2**16))
    for mode in ("owner", "owner-z3", "owner-ddp", "replicated", "sharded", "sign"):
        m = p.modes[mode]
        # the same step but Newton–Schulz, which batches per step unit (sign mode too:
        # engine/sign.py steps layer by layer, vanilla Muon one batch per shape)
        units = step_units(llama, p.plan, mode)
        calls = rule_calls(llama.matrices, units, batch_limit=1 << 62)
        assert m.ns_s == pytest.approx(unit_work(calls, cost)[0], rel=1e-12), mode
        assert m.ns_s > vanilla.ns_s, mode  # more calls than one batch per shape
        assert m.step_s - m.ns_s == pytest.approx(vanilla.step_s - vanilla.ns_s, rel=1e-12)
        assert m.ns_flops_max == vanilla.ns_flops_max
        assert m.bytes_dmuon == m.bytes_framework == 0
    assert set(p.modes) == set(ALL_MODES)


def test_dmuon_divides_newton_schulz_and_beats_vanilla_at_scale(llama):
    p = predict(llama, cluster(64), TrainingShape(global_tokens=2**22))
    assert p.modes["owner"].ns_s < p.modes["vanilla"].ns_s / 30
    assert p.modes["owner"].speedup_vs_vanilla > 1
    # every rank, every matrix, layer by layer (engine/sign.py): more calls than vanilla's
    assert p.modes["sign"].ns_s > p.modes["vanilla"].ns_s


def test_exposed_communication_under_overlap():
    spec = load_model("gpt2")
    slow = ClusterProfile(DEVICES["H100"], 16, 8, INTERCONNECTS["nvlink4"],
                          Link("slow", 1e8, alpha=0.0))  # fmt: skip
    long = predict(spec, slow, TrainingShape(fwd_bwd_s=1e4), modes=("owner",)).modes["owner"]
    L = len(spec.layers)
    # a compute window longer than the communication: only the last layer's share shows
    for phase in ("forward", "backward"):
        assert long.exposed_s[phase] == pytest.approx(long.comm_s[phase] / L)
    short = predict(spec, slow, TrainingShape(fwd_bwd_s=1e-3), modes=("owner",)).modes["owner"]
    # the window: backward's compute and FSDP2's copies of the scalars in backward (the
    # re-gather's and the reduce-scatter's: two of the three equal copies)
    window = 2e-3 / 3 + 2 * short.copies_s / 3
    assert short.exposed_s["backward"] == pytest.approx(short.comm_s["backward"] - window)
    assert short.step_s > long.step_s - 1e4 + 1e-3


def test_memory_modes_order(llama):
    p = predict(llama, cluster(64), TrainingShape(global_tokens=2**22))
    mem = {k: m.memory["total"] for k, m in p.modes.items()}
    assert mem["owner-z3"] < mem["owner"] < mem["replicated"]
    assert mem["sharded"] < mem["owner"]
    assert p.modes["replicated"].memory["weights"] == llama.total_params * 2


def test_matrix_state_follows_the_rule_and_the_state_dtype(llama):
    """The state of the matrix rule, counted from the rule's declared state, equals the
    bytes of a real DMuon's state tensors for the same matrices (the sign mode holds
    every matrix's state on every rank)."""
    import torch

    from dmuon.optim import DMuon, get_rule

    def state_bytes(rule, state_dtype):
        shape = TrainingShape(global_tokens=2**22, rule=rule, state_dtype=state_dtype)
        p = predict(llama, cluster(8), shape, modes=("sign",))
        return p.modes["sign"].memory["optimizer_state"] - 8 * llama.scalar_params

    def measured(rule, state_dtype):
        # two of the model's shapes, each divided by 32 (the count per element is what is
        # checked; the full shapes cost a minute of emulated-bf16 Newton–Schulz on a CPU),
        # bf16 like the planner's default
        shapes = sorted({(i.rows // 32, i.cols // 32) for i in llama.matrices})[:2]
        ws = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
        opt = DMuon(ws, rule=rule, state_dtype=state_dtype)
        for w in ws:
            w.grad = torch.ones_like(w)
        opt.step()
        per_element = sum(
            v.numel() * v.element_size() for w in ws for k, v in opt.state[w].items() if k != "step"
        )
        return per_element, shapes

    muon = state_bytes("muon", None)
    assert muon == llama.matrix_params * 2  # the momentum, bf16 like the weights
    assert state_bytes("muon", "float32") == 2 * muon
    assert state_bytes("adamuon", None) == 2 * muon  # momentum + full second moment
    rows = sum(i.batch * i.rows for i in llama.matrices)
    assert state_bytes("normuon", "float32") == 4 * (llama.matrix_params + rows)
    for rule, dtype in (("muon", None), ("adamuon", "float32"), ("normuon", "bfloat16")):
        got, shapes = measured(rule, dtype)
        specs = [x.kind for x in get_rule(rule).state_specs()]
        size = 2 if dtype in (None, "bfloat16") else 4
        want = sum(
            size * (specs.count("matrix") * m * n + specs.count("row") * m) for m, n in shapes
        )
        assert got == want, (rule, dtype)
    with pytest.raises(ValueError, match="--state-dtype must be float32 or bfloat16"):
        TrainingShape(state_dtype="float16")
    with pytest.raises(ValueError, match="--rule must be one of"):
        TrainingShape(rule="adam")


def test_framework_traffic_formulas(llama):
    n, b = 8, 2
    fsdp = framework_transfers(llama, "adamw", n)
    assert [t.op for t in fsdp] == [
        "fsdp_all_gather",
        "fsdp_all_gather_backward",
        "fsdp_reduce_scatter",
    ]
    assert fsdp[2].sent[0] == pytest.approx((n - 1) / n * llama.total_params * b, rel=1e-9)
    ddp = framework_transfers(llama, "replicated", n)[0]
    assert ddp.sent[0] == pytest.approx(2 * (n - 1) / n * llama.total_params * b, rel=1e-9)
    assert framework_transfers(llama, "adamw", 1) == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DeviceProfile("x", 0.0, 1e9, 1e9), "peak_flops must be a finite number > 0"),
        (lambda: DeviceProfile("x", 1e12, 1e9, 0), "memory_bandwidth must be a finite number"),
        (lambda: DeviceProfile("x", 1e12, 1e9, 1e9, ns_efficiency=0), "ns_efficiency must be"),
        (lambda: Link("ib", 0.0), "bandwidth must be a finite number > 0"),
        (lambda: Link("ib", 1e9, alpha=-1), "alpha must be ≥ 0"),
        (lambda: TrainingShape(mfu=0), "mfu must be in"),
        (lambda: TrainingShape(fwd_bwd_s=0), "fwd_bwd_s"),
        (lambda: cluster(0), "gpus must be an int ≥ 1"),
    ],
)
def test_zero_rates_and_bad_shapes_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_device_profiles_load_from_presets_and_json(tmp_path):
    assert load_device_profile("a800").memory_bandwidth == 2.039e12
    path = tmp_path / "p.json"
    custom = DeviceProfile("mine", 1e12, 8e9, 1e11, ns_efficiency=0.5)
    import json

    path.write_text(json.dumps(custom.to_json()))
    assert load_device_profile(str(path)) == custom
    path.write_text(json.dumps({**custom.to_json(), "speed": 1}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['speed'\]"):
        load_device_profile(str(path))
    # a benchmarks/gpu_check.py result: the GPU named, NS rates measured
    check = {
        "meta": {"gpu": "NVIDIA H100 80GB HBM3"},
        "ns": [{"status": "ok", "tflops": t} for t in (400.0, 500.0, 450.0)],
        "gemm_flops": {"bfloat16": 7e14},
    }
    path.write_text(json.dumps(check))
    got = load_device_profile(str(path))
    assert got.name == "H100" and got.ns_efficiency == pytest.approx(450e12 / 989e12)
    path.write_text(json.dumps({"meta": {"gpu": "Some GPU"}}))
    with pytest.raises(ValueError, match="names none of"):
        load_device_profile(str(path))
    with pytest.raises(ValueError, match="neither a preset"):
        load_device_profile("TPUv9")


def test_a_profile_without_overlap_exposes_all_communication():
    spec = load_model("gpt2")
    cpu = DeviceProfile("cpu", 5e10, 8e9, 5e9, overlap=False)
    link = Link("gloo", 5e8, alpha=1e-4)
    c = ClusterProfile(cpu, 4, 4, link, link)
    for mode in ("owner", "sharded", "adamw"):
        m = predict(spec, c, TrainingShape(fwd_bwd_s=10.0), modes=(mode,)).modes[mode]
        assert m.exposed_s["forward"] == m.comm_s["forward"] > 0
        assert m.exposed_s["backward"] == m.comm_s["backward"] > 0
        assert m.exposed_s["step"] == pytest.approx(m.comm_s["step"])
    with pytest.raises(ValueError, match="overlap must be true or false"):
        DeviceProfile("cpu", 5e10, 8e9, 5e9, overlap="no")  # type: ignore[arg-type]


def test_owner_mode_scalar_layouts_and_their_refusals(llama):
    """ddp.dedicate's all-reduced scalars add their whole AdamW state to every rank; an
    owned-scalar plan must hold the scalars; the layouts are owner mode's alone. (Equal to
    DMuon's state on real ranks: tests-integration/test_planner_memory_owner.py.)"""
    from dmuon.comm import MatrixItem
    from dmuon.optim.planner.memory import memory_per_rank

    n, ps = 4, llama.scalar_params
    plan = plan_owners(llama.matrices, n)
    sharded = memory_per_rank(llama, plan, "owner")
    reduced = memory_per_rank(llama, plan, "owner", scalars="all_reduce")
    assert reduced["optimizer_state"] - sharded["optimizer_state"] == 8 * ps * (1 - 1 / n)
    assert reduced["weights"] == reduced["gradients"] == llama.total_params * 2
    scalars = [MatrixItem(name, (1, k), torch.bfloat16) for name, k in llama.scalars]
    owned = plan_owners([*llama.matrices, *scalars], n)
    got = memory_per_rank(llama, owned, "owner", scalars="owner")["optimizer_state"]
    names = {name for name, _ in llama.scalars}
    want = max(
        sum(2 * i.numel if i.name not in names else 8 * i.numel for i in owned.items_of(r))
        for r in range(n)
    )  # Muon's bf16 momentum per owned matrix, AdamW's two fp32 moments per owned scalar
    assert got == want
    with pytest.raises(ValueError, match="holds none of them"):
        memory_per_rank(llama, plan, "owner", scalars="owner")
    with pytest.raises(ValueError, match=r"'all_reduce' is ddp\.dedicate's owner mode"):
        memory_per_rank(llama, plan, "sharded", scalars="all_reduce")
    with pytest.raises(ValueError, match="scalars must be one of"):
        memory_per_rank(llama, plan, "owner", scalars="zero1")


def test_fsdp2_collectives_charge_their_copies_at_the_memory_rate():
    # FSDP2 copies 2·B·(1 + 1/N) bytes around each collective (copy-in and copy-out):
    # three collectives of the whole model for AdamW, at the memory rate, compute-side
    # work in the step; with overlap it widens the window the transfers hide behind.
    # DDP's all-reduce (replicated) carries no copy charge.
    spec = load_model("gpt2")
    n, b, bw = 4, spec.matrices[0].dtype.itemsize, 2e9
    link = Link("gloo", 5e8, alpha=1e-4)
    copied = 3 * 2 * spec.total_params * b * (1 + 1 / n) / bw
    for overlap in (False, True):
        dev = DeviceProfile("d", 5e10, 8e9, bw, memory_efficiency=1.0, overlap=overlap)
        c = ClusterProfile(dev, n, n, link, link)
        shape = TrainingShape(fwd_bwd_s=0.3)
        modes = predict(spec, c, shape, modes=("adamw", "replicated")).modes
        m = modes["adamw"]
        assert m.copies_s == pytest.approx(copied)
        assert modes["replicated"].copies_s == 0.0
        exposed = sum(m.exposed_s[k] for k in ("forward", "backward"))
        assert m.step_s == pytest.approx(0.3 + copied + exposed + m.optimizer_s)
        if overlap:  # the forward's third of the copies widens its window
            layers = len(spec.layers)
            window = 0.1 + copied / 3
            want = max(m.comm_s["forward"] / layers, m.comm_s["forward"] - window)
            assert m.exposed_s["forward"] == pytest.approx(want)
        else:
            assert m.exposed_s["forward"] == m.comm_s["forward"]


def test_sign_mode_adds_the_calibrated_sign_and_vote_work_and_nothing_else():
    spec = load_model("gpt2")
    link = Link("gloo", 5e8, alpha=1e-4)
    plain = DeviceProfile("cpu", 5e10, 8e9, 5e9, overlap=False)
    signed = DeviceProfile("cpu", 5e10, 8e9, 5e9, overlap=False, sign_overhead=2e-3,
                           vote_overhead=3e-9)  # fmt: skip
    shape = TrainingShape(fwd_bwd_s=1.0)

    def modes(d: DeviceProfile) -> dict:
        return predict(spec, ClusterProfile(d, 4, 4, link, link), shape, modes=ALL_MODES).modes

    a, b = modes(plain), modes(signed)
    matrices = sum(i.batch for i in spec.matrices)
    extra = matrices * 2e-3 + spec.matrix_params * 3e-9
    assert b["sign"].ns_s - a["sign"].ns_s == pytest.approx(extra)
    assert b["sign"].step_s - a["sign"].step_s == pytest.approx(extra)
    for mode in ALL_MODES:
        if mode != "sign":
            assert b[mode].step_s == a[mode].step_s, mode
    with pytest.raises(ValueError, match="vote_overhead must be ≥ 0 seconds"):
        DeviceProfile("cpu", 5e10, 8e9, 5e9, vote_overhead=-1.0)


def test_a_measured_collective_bandwidth_prices_that_collective_alone():
    # gloo's all-gather moves its ring bytes slower than its all-reduce: a link that
    # measured it prices FSDP2's all-gathers at it, and nothing else changes
    spec = load_model("gpt2")
    n = 4
    plain = Link("gloo", 1e9, alpha=1e-4, efficiency=1.0)
    slow = Link("gloo", 1e9, alpha=1e-4, efficiency=1.0, collective_bandwidth={"all_gather": 2.5e8})
    dev = DeviceProfile("cpu", 5e10, 8e9, 5e9, overlap=False)

    def comm(link: Link, mode: str) -> dict[str, float]:
        c = ClusterProfile(dev, n, n, link, link)
        return predict(spec, c, TrainingShape(fwd_bwd_s=1.0), modes=(mode,)).modes[mode].comm_s

    ring = 3 / 4 * spec.total_params * spec.matrices[0].dtype.itemsize  # (N−1)/N · Φe
    assert comm(slow, "adamw")["forward"] - comm(plain, "adamw")["forward"] == pytest.approx(
        ring / 2.5e8 - ring / 1e9
    )
    assert comm(slow, "adamw-ddp") == comm(plain, "adamw-ddp")  # DDP's all-reduce only
    with pytest.raises(ValueError, match=r"collective_bandwidth\['all_gather'\] must be"):
        Link("gloo", 1e9, collective_bandwidth={"all_gather": 0.0})


def test_owned_scalars_are_planned_as_their_element_wise_work():
    """ddp.dedicate(scalars="owner") plans each scalar as one row, whose NSCost is its byte
    term: the element-wise work of its owner's AdamW. Llama-3.1-8B on 64 H100s as 8 dp ×
    tp 8 (the planning guide's second example): the plan places the matrices around the
    embedding's and the head's AdamW, and the busiest rank's Newton–Schulz stays that of
    owner-ddp (which plans the matrices alone) to 1 %. Before, the two 128256 × 4096
    scalars were planned by their shape, as the Newton–Schulz of a 4096 × 128256 matrix
    that no rank runs (36 ms each at this profile against 4 ms as a row): their owners
    got no other matrix, the others more, and the NS time was 80.6 ms against 76.2 ms."""
    spec = load_model("llama-3.1-8b")
    shape = TrainingShape(global_tokens=4194304, seq_len=4096, mfu=0.4, tp=8)
    p = predict(spec, cluster(64), shape, modes=("owner-ddp", "owner-ddp-zero1"))
    zero1, ddp = p.modes["owner-ddp-zero1"].ns_s, p.modes["owner-ddp"].ns_s
    assert zero1 == pytest.approx(ddp, rel=0.01), (zero1, ddp)


def test_owner_ddp_zero1_keeps_the_scalars_adamw_state_on_their_owners_only(llama):
    """ddp.dedicate(scalars="owner"): the scalars are planned with the matrices, whole
    (each as one row, costed as its element-wise work), and each one's two fp32 AdamW moments
    live on its owner alone; weights, gradients and buckets stay whole on every rank, as
    ddp.dedicate's all-reduced mode (owner-ddp) keeps them. The reference is counted here
    from the plan the engine would make. (Bytes against real ranks:
    tests-integration/test_planner_traffic.py.)"""
    from dmuon.optim.planner.traffic import owned_scalar_items

    n = 8
    shape = TrainingShape(global_tokens=2**20)
    p = predict(llama, cluster(n), shape, modes=("owner-ddp", "owner-ddp-zero1"))
    zero1, ddp = p.modes["owner-ddp-zero1"], p.modes["owner-ddp"]
    scalars = owned_scalar_items(llama)
    assert [(i.name, i.numel) for i in scalars] == list(llama.scalars)
    assert scalars[0].shape == (1, 128256 * 3072)  # model.embed_tokens.weight, one row
    # the plan the engine makes: every matrix and every scalar, by the same cost
    plan = plan_owners([*llama.matrices, *scalars], n, cost=ns_cost(cluster(n), shape))
    names = {name for name, _ in llama.scalars}
    per_rank = [
        sum(
            8 * i.numel if i.name in names else 2 * i.numel  # AdamW fp32 m, v; Muon bf16 momentum
            for i in plan.items_of(r)
        )
        for r in range(n)
    ]
    assert zero1.memory["optimizer_state"] == max(per_rank)
    # every scalar's state is somewhere, once: the ranks' scalar state sums to 8·Φ_S
    assert sum(8 * i.numel for r in range(n) for i in plan.items_of(r) if i.name in names) == (
        8 * llama.scalar_params
    )
    # owner-ddp holds every scalar's state on every rank
    assert max(per_rank) < ddp.memory["optimizer_state"]
    for kind in ("weights", "gradients", "buffers"):
        assert zero1.memory[kind] == ddp.memory[kind] == llama.total_params * 2, kind
    # the busiest owner's AdamW: only the scalars it owns, never all of them
    assert zero1.adamw_s < ddp.adamw_s
    # its traffic: the scalars reduced to and broadcast from their owners in the units'
    # buckets (no all-reduce, no framework traffic), as many bytes as owner-ddp's
    # reduce + broadcast + all-reduce (each a ring all-reduce's 2(N−1)/N of the bytes)
    ops = {t.op for t in zero1.transfers}
    assert "all_reduce_replicated" in {t.op for t in ddp.transfers}
    assert ops == {"reduce_to_owners", "broadcast_from_owners", "presence_flags"}
    assert zero1.bytes_framework == 0
    moved = sum(max(t.sent) for t in zero1.transfers if t.op != "presence_flags")
    assert moved == pytest.approx(2 * (n - 1) / n * llama.total_params * 2)
    # a plan without the scalars is refused by name
    with pytest.raises(ValueError, match=r"owner-ddp-zero1.*lacks 58 scalar"):
        dmuon_transfers(llama, plan_owners(llama.matrices, n), "owner-ddp-zero1")
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight"):
        step_units(llama, plan_owners(llama.matrices, n), "owner-ddp-zero1")
