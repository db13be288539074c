"""The planner cuts owner mode's units by the engine's packing rule, over the same bytes.

Owner mode packs consecutive small layers into one unit
(:func:`dmuon.optim.engine.layer_record.pack_layers`); the planner prices one round of
collectives per unit (:func:`dmuon.optim.planner.traffic._owner_units`). Checked here on
random layouts against the engine's own packing of real tensors: the same grouping,
with the exchange's all-reduced scalars (``ddp.dedicate``) and without them
(``fsdp.dedicate``); and that a tensor-parallel model, which the exchange never packs,
is priced a layer a unit.
"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dmuon.comm import MatrixItem, plan_owners
from dmuon.optim.engine.layer_packing import pack_runs
from dmuon.optim.engine.layer_record import group_layers, pack_layers
from dmuon.optim.planner.config import spec_from_hf_config
from dmuon.optim.planner.profiles import DEVICES, INTERCONNECTS, ClusterProfile
from dmuon.optim.planner.step_model import TrainingShape, predict
from dmuon.optim.planner.traffic import _owner_units, dmuon_transfers

DTYPES = (torch.float32, torch.bfloat16)

# one layer: its matrices (rows, cols, dtype index) and its scalars (numel)
layer_strategy = st.tuples(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(0, 1)), max_size=3),
    st.lists(st.integers(1, 12), max_size=3),
)


def _layout(layers, world, all_reduce):
    """The engine's inputs for ``layers``: dedicated (item, tensor) pairs, all-reduced
    (name, layer, tensor) triples (none unless ``all_reduce``), and the owner plan."""
    dedicated, replicated = [], []
    for i, (matrices, scalars) in enumerate(layers):
        key = f"blocks.{i}"
        for j, (m, n, d) in enumerate(matrices):
            name = f"{key}.w{j}"
            dedicated.append(
                (MatrixItem(name, (m, n), DTYPES[d], key), torch.zeros(m, n, dtype=DTYPES[d]))
            )
        if all_reduce:
            replicated += [(f"{key}.b{j}", key, torch.zeros(s)) for j, s in enumerate(scalars)]
    plan = plan_owners([item for item, _ in dedicated], world)
    return dedicated, replicated, plan


def _engine_units(dedicated, replicated, plan, max_bytes):
    layers, params, layer_of = group_layers(dedicated, replicated, plan)
    packed, _ = pack_layers(layers, params, layer_of, max_bytes)
    return [list(p.members) for p in packed]


def _planner_units(replicated, plan, max_bytes):
    scalars = [(name, key, p.numel() * p.element_size()) for name, key, p in replicated]
    return _owner_units(plan, max_bytes, all_reduced=scalars)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    layers=st.lists(layer_strategy, min_size=1, max_size=14).filter(
        lambda ls: any(m for m, _ in ls)
    ),
    max_bytes=st.integers(0, 400),
    world=st.integers(1, 3),
    all_reduce=st.booleans(),
)
# the scalars push a pack over the limit: 2 × 64 bytes of matrices fit 160 bytes,
# with 2 × 12 floats of scalars beside them they do not (a planner that counts the
# matrices alone prices one unit where the engine makes two)
@example(layers=[([(4, 4, 0)], [12]), ([(4, 4, 0)], [12])], max_bytes=160, world=2,
         all_reduce=True)  # fmt: skip
def test_the_planner_units_are_the_engine_packs(layers, max_bytes, world, all_reduce):
    dedicated, replicated, plan = _layout(layers, world, all_reduce)
    engine = _engine_units(dedicated, replicated, plan, max_bytes)
    assert _planner_units(replicated, plan, max_bytes) == engine


def test_scalars_count_in_a_pack():
    # the hand count of the @example above
    dedicated, replicated, plan = _layout([([(4, 4, 0)], [12]), ([(4, 4, 0)], [12])], 2, True)
    assert _engine_units(dedicated, replicated, plan, 160) == [["blocks.0"], ["blocks.1"]]
    assert _planner_units(replicated, plan, 160) == [["blocks.0"], ["blocks.1"]]
    assert _planner_units([], plan, 160) == [["blocks.0", "blocks.1"]]  # fsdp.dedicate's


def test_pack_runs_is_the_greedy_rule():
    layers = [("a", 16, None), ("b", 16, None), ("c", 40, None), ("d", 8, "x"), ("e", 8, "x")]
    assert pack_runs(layers, 32) == [["a", "b"], ["c"], ["d", "e"]]
    assert pack_runs(layers, 0) == [[k] for k, *_ in layers]
    assert pack_runs(layers, 10**9) == [["a", "b", "c"], ["d", "e"]]
    with pytest.raises(ValueError, match="max_bytes"):
        pack_runs(layers, -1)
    with pytest.raises(ValueError, match="nbytes"):
        pack_runs([("a", -1, None)], 8)


def test_a_tensor_parallel_model_is_priced_a_layer_a_unit():
    # The exchange packs no layer of a tensor-parallel model (its matrices are DTensors:
    # OwnerExchange leaves them one layer a unit). Before, the planner packed this small
    # model's four layers (≈ 0.4 MiB of shards each) into two units under tp = 2.
    cfg = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 256}  # fmt: skip
    spec = spec_from_hf_config(cfg, name="tiny")
    cluster = ClusterProfile(DEVICES["H100"], 8, 8, INTERCONNECTS["nvlink4"],
                             INTERCONNECTS["ib-ndr"])  # fmt: skip
    for tp, rounds in ((1, 2), (2, 4)):
        p = predict(spec, cluster, TrainingShape(global_tokens=2**16, tp=tp), modes=("owner",))
        (reduce,) = [t for t in p.modes["owner"].transfers if t.op == "reduce_to_owners"]
        assert reduce.rounds == rounds, tp
    # the pack limit itself, as the exchange's layer_pack_mb
    plan = plan_owners(spec.matrices, 4)
    for mb, rounds in ((0, 4), (1.0, 2)):
        (reduce,) = [t for t in dmuon_transfers(spec, plan, "owner", layer_pack_mb=mb)
                     if t.op == "reduce_to_owners"]  # fmt: skip
        assert reduce.rounds == rounds
    with pytest.raises(ValueError, match="layer_pack_mb"):
        dmuon_transfers(spec, plan, "owner", layer_pack_mb=-1)
