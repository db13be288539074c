"""The planner prices a tensor-parallel batch as the engine runs it: one call, one path.

The engine steps the same-shape split matrices of a step unit as one batched rule call
and decides their tensor-parallel path once for the call
(``StepContext._gathers``: :func:`dmuon.comm.tensor_parallel_path` with the call's
batch), issuing the path's collectives once for the whole batch. The reference here is
the engine's own decision, asked of a :class:`~dmuon.optim.transforms.StepContext` on a
batch of shards, and :func:`dmuon.comm.tensor_parallel_path`'s bytes for that batch.
"""

import dataclasses

import pytest
import torch

from dmuon.comm import MatrixItem, NSCost, tensor_parallel_path
from dmuon.comm.cost_model import DEFAULT_ALPHA, DEFAULT_BANDWIDTH
from dmuon.optim.matrix_split import MatrixSplit
from dmuon.optim.planner.config import ModelSpec
from dmuon.optim.planner.parallel import layout, tp_choices
from dmuon.optim.planner.profiles import DEVICES, ClusterProfile, Link
from dmuon.optim.planner.step_model import TrainingShape, predict
from dmuon.optim.transforms import StepContext

M, N, T = 2048, 512, 2  # colwise (rows split): alone the gather path, five together the Gram
NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def spec(layers=1):
    items = tuple(
        MatrixItem(
            f"model.layers.{k}.{'self_attn' if w[0] in 'qkv' else 'mlp'}.{w}.weight",
            (M, N),
            dtype=torch.float32,
            layer=f"model.layers.{k}",
        )
        for k in range(layers)
        for w in NAMES
    )
    return ModelSpec("five", items, (("model.norm.weight", N),), sum(i.numel for i in items))


def engine_cluster(n):
    """A profile at the rates the engine's tp_path="auto" prices with (its defaults)."""
    device = dataclasses.replace(
        DEVICES["H100"], peak_flops=NSCost.flops_per_second, ns_efficiency=1.0
    )
    link = Link("engine", DEFAULT_BANDWIDTH, alpha=DEFAULT_ALPHA, efficiency=1.0, source="")
    return ClusterProfile(device, n, n, link, link)


SHAPE = TrainingShape(global_tokens=1024, tp=T, ns_compute_dtype="float32")


def engine_gathers(batch):
    """Whether the engine's rule chain gathers a batch of ``batch`` shards (its own code)."""
    split = MatrixSplit(
        dim=-2, shape=(M, N), reduce=lambda t, op: t, group="tp", gather=lambda x: x,
        world_size=T,
    )  # fmt: skip
    X = torch.zeros(batch, M // T, N)
    hp = {"tp_path": "auto", "ns_compute_dtype": "float32"}
    ctx = StepContext(grad=X, hp=hp, split=split)
    return ctx._gathers(X, "gram", 5)


def test_engine_tp_path_is_the_engines_decision():
    from dmuon.optim.planner.parallel import engine_tp_path

    for batch in (1, 2, 4, 5, 8):
        got = engine_tp_path(
            M, N, -2, T, batch=batch, gram_element_size=4, gather_element_size=4,
            method="gram", steps=5,
        )  # fmt: skip
        assert (got == "gather") == engine_gathers(batch), batch
    # the case below: a matrix alone is gathered, the five of a layer take the Gram path
    assert engine_gathers(1) and not engine_gathers(5)


@pytest.mark.parametrize("mode", ["owner", "replicated", "sharded", "sign"])
def test_a_batch_takes_the_path_the_engine_takes_for_it(mode):
    c = engine_cluster(T)  # dp 1 × tp 2: one row steps the five matrices as one call
    p = predict(spec(), c, SHAPE, modes=(mode,))
    alone = tp_choices(spec(), p.layout, c, method="gram", steps=5, gram_element_size=4)
    assert {ch.path for ch in alone.values()} == {"gather"}  # the path at batch 1
    moved = [t for t in p.modes[mode].transfers if t.inside_ns]
    assert [t.op for t in moved] == ["tensor_parallel_reduce"]  # the Gram path, as the engine
    want = tensor_parallel_path(M, N, -2, T, element_size=4, batch=5)
    assert moved[0].sent == [want.gram_bytes]
    # its collectives once for the call: the Gram all-reduces (1 + 1 restart) and the
    # normalisation's two
    assert moved[0].collectives == 4


@pytest.mark.parametrize("mode", ["owner", "sign"])
def test_the_normalisation_of_a_batch_is_sent_once(mode):
    # forced Gram path: a batch of b matrices sends b maxima and b + 1 norms (fp32), not
    # b times one matrix's 1 + 2
    c = engine_cluster(T)
    shape = dataclasses.replace(SHAPE, tp_path="gram")
    p = predict(spec(), c, shape, modes=(mode,))
    moved = [t for t in p.modes[mode].transfers if t.inside_ns]
    batched = tensor_parallel_path(M, N, -2, T, element_size=4, batch=5).gram_bytes
    one = tensor_parallel_path(M, N, -2, T, element_size=4, batch=1).gram_bytes
    assert moved[0].sent == [batched]
    assert 5 * one - batched == 4 * 4  # the split size appended once, not five times
    assert p.modes[mode].bytes_tp == batched


def test_sign_mode_prices_its_tp_batches_as_owner_mode_at_dp_1():
    # dp 1: owner mode's one row and sign mode's every rank step the same matrices, in the
    # same calls (a layer each, engine/sign.py), so the same NS and tp time and FLOPs
    c = engine_cluster(T)
    p = predict(spec(layers=3), c, SHAPE, modes=("owner", "sign"))
    owner, sign = p.modes["owner"], p.modes["sign"]
    assert sign.tp_s == pytest.approx(owner.tp_s, rel=1e-12)
    assert sign.ns_s == pytest.approx(owner.ns_s, rel=1e-12)
    assert sign.ns_flops_max == owner.ns_flops_max
    # three calls (one per layer) of five: the latency of three batches, not of fifteen
    lay = layout(spec(layers=3), T, T, cost=NSCost())
    priced = tensor_parallel_path(
        M, N, -2, T, element_size=4, batch=5, flops_per_second=NSCost.flops_per_second,
        alpha=DEFAULT_ALPHA, bandwidth=DEFAULT_BANDWIDTH,
    )  # fmt: skip
    assert len(lay.splits) == 15
    flops = tensor_parallel_path(
        M, N, -2, T, element_size=4, batch=5, flops_per_second=1.0, alpha=0.0,
        bandwidth=float("inf"),
    ).gram_seconds  # fmt: skip
    comm = priced.gram_seconds - flops / NSCost.flops_per_second
    assert sign.tp_s == pytest.approx(3 * comm, rel=1e-9)
