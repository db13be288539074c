"""The planned modes (``replicated``, ``sharded``, ``sign``) pack consecutive small layers.

Each planned mode steps its matrices unit by unit: per unit one collective (the
all-gather of the owners' results, the all-to-all of the shards there and back, the
sign vote of each batched call) and one batched rule call per shape. On a model of
many small layers the collectives' latency bounds that step, as in owner mode, so
consecutive layers whose matrices hold at most ``layer_pack_mb`` MiB together (whole,
DMuon's keyword, default 1 MiB) are one unit (``PlannedEngine._pack``, owner mode's
rule ``pack_runs``). Every transform acts on each matrix alone, so packing changes no
number.

Checked here, on two gloo ranks: the four-block GPT is one unit by default and four
with ``layer_pack_mb=0``; packed and unpacked give bitwise the same weights, which are
the one-process run's of the same global batch; a pack collects its layers' matrices
(``group_of``); the collectives are counted per unit; owner mode refuses the keyword
(its dedication packs), and a bad value is refused naming it.
"""

from __future__ import annotations

import pytest
import torch
from distributed_cases import (
    OPT,
    batch,
    build,
    full_params,
    loss_of,
    max_diff,
    reference,
    setup,
)

from dmuon.comm import default_stats
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

MODES = ("replicated", "sharded", "sign")
STEPS = 3
# the collectives each planned mode issues per unit (CommStats' names)
UNIT_OPS = {
    "replicated": ("all_gather_updates",),
    "sharded": ("shard_all_to_all", "shard_all_to_all_reverse"),
    "sign": ("majority_vote[packed]",),
}


def _options(mode: str, pack_mb: float | None) -> dict[str, object]:
    kw: dict[str, object] = dict(OPT, rule="sign_muon") if mode == "sign" else dict(OPT)
    if pack_mb is not None:
        kw["layer_pack_mb"] = pack_mb
    return kw


def _train(rank: int, world: int, mode: str, pack_mb: float | None):
    if mode == "sign":  # every rank steps every matrix on its own gradients' votes
        torch.manual_seed(0)
        model = build("gpt_deep")
        forward, opt = model, DMuon(param_groups(model), mode="sign", **_options(mode, pack_mb))
    else:
        model, forward, opt, _ = setup(mode, "gpt_deep", world, _options(mode, pack_mb))
    counts: dict[str, int] = {}
    for t in range(STEPS):
        default_stats().reset()
        loss_of("gpt", forward, *batch("gpt", t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        counts = {k: v.collectives for k, v in default_stats().ops.items()}
    engine = opt.engine
    packs = {key: sorted({e.layer for e in engine.matrices(key)}) for key in engine.layers}
    grouped = {engine.group_of(e.param) for e in engine.matrices()}
    return packs, grouped, counts, opt.last_step.groups, full_params(model)


@pytest.mark.parametrize("mode", MODES)
def test_small_layers_are_one_unit_and_step_as_unpacked_and_one_process(mode):
    world = 2
    packed = run_on_ranks(_train, world, args=(mode, None), timeout=240)
    alone = run_on_ranks(_train, world, args=(mode, 0), timeout=240)
    layers = [f"blocks.{i}" for i in range(4)]
    for rank in range(world):
        packs, grouped, counts, groups, weights = packed[rank]
        assert packs == {"blocks.0..blocks.3": layers}, packs
        assert grouped == {"blocks.0..blocks.3"} and groups == 1, (grouped, groups)
        packs0, grouped0, counts0, groups0, weights0 = alone[rank]
        assert packs0 == {k: [k] for k in layers} and grouped0 == set(layers), packs0
        assert groups0 == 4
        for op in UNIT_OPS[mode]:
            # one collective per unit (sign: per batched call of a unit, one per shape)
            assert counts[op] * 4 == counts0[op], (op, counts[op], counts0[op])
        same, where = max_diff(weights, weights0)
        assert same == 0.0, f"{mode}, rank {rank}: packed differs from unpacked at {where}"
    if mode != "sign":  # sign mode votes on each rank's own gradients: no one-process twin
        diff, where = max_diff(packed[0][4], reference("gpt_deep", world, steps=STEPS))
        assert diff < 1e-5, f"{mode}: {diff} at {where}"


def _owner_with_pack(rank: int, world: int) -> str:
    from dmuon.integrations import ddp

    model = build("gpt")
    ded = ddp.dedicate(model)
    try:
        DMuon(param_groups(model), distributed=ded, layer_pack_mb=4.0, **OPT)
    except ValueError as err:
        return str(err)
    finally:
        ded.undedicate()
    return "no error"


def test_owner_mode_refuses_the_keyword_its_dedication_takes():
    for said in run_on_ranks(_owner_with_pack, 2, timeout=120):
        assert "pass it to dedicate(..., layer_pack_mb=) instead" in said, said


@pytest.mark.parametrize("bad", [-1, float("nan"), "1", True])
def test_a_bad_pack_size_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="layer_pack_mb must be a number of MiB >= 0"):
        DMuon(param_groups(build("gpt")), layer_pack_mb=bad, **OPT)


def _packs_differently(rank: int, world: int) -> str:
    from dmuon.optim import ModelMismatchError

    try:
        setup("sharded", "gpt_deep", world, _options("sharded", 0 if rank == 1 else None))
    except ModelMismatchError as err:
        return str(err)
    return "no error"


def test_ranks_that_pack_differently_are_told_on_every_rank_before_any_step():
    """Another ``layer_pack_mb`` on one rank would issue other collectives: the model
    check at construction compares each matrix's unit and names it, on every rank."""
    for said in run_on_ranks(_packs_differently, 2, timeout=120):
        assert "blocks.0..blocks.3" in said and "layer_pack_mb" in said, said
