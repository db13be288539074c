"""DeepSpeed checkpoints keep DMuon's state: a resume equals the uninterrupted run bit for bit.

For each (ZeRO stage, mode) DMuon serves under DeepSpeed, 2 gloo ranks train a small
GPT 2 steps, save with ``dmuon.integrations.deepspeed.save_checkpoint`` and train 2
more (the uninterrupted run). A fresh engine on the same ranks loads the checkpoint
with ``load_checkpoint`` and trains the same 2 steps: its weights must equal the
uninterrupted run's bitwise (CPU, same world size, same plan). Controls: a resume
that loads the weights only (``load_optimizer_states=False``) must differ (so the
equality proves the optimizer state came back); ``engine.load_checkpoint`` alone at
ZeRO-1/2 must raise instead of training on with the matrices' momentum at zero; a
checkpoint saved by ``engine.save_checkpoint`` alone must be refused before anything
is loaded, and so must a checkpoint whose DMuon part does not fit (another rule),
leaving the engine untouched. Then one process loads the stage-0 checkpoints (DMuon's
part resharded to a plan of one rank) and must reach the 2-rank run's weights to 1e-5.
"""

from __future__ import annotations

import os

from deepspeed_cases import CASES, deepspeed_config, import_deepspeed, needs_deepspeed
from distributed_cases import (
    OPT,
    TOLERANCE,
    batch,
    build,
    full_params,
    loss_of,
    max_diff,
)

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations.checkpoint import CheckpointMismatchError

pytestmark = needs_deepspeed

WORLD = 2
SAVED_AT = 2  # steps before the checkpoint
AFTER = 2  # steps after it


def _engine(stage: int, mode: str, world: int, **options):
    from dmuon.integrations import deepspeed as dmuon_ds

    config = deepspeed_config(stage, world)
    model = build("gpt")
    engine, _, _, _ = dmuon_ds.initialize(model, config, mode=mode, **{**OPT, **options})
    return engine


def _train(engine, steps: range, rank: int, world: int) -> dict:
    from dmuon.integrations import deepspeed as dmuon_ds

    for t in steps:
        engine.backward(loss_of("gpt", engine, *batch("gpt", t, rank, world)))
        engine.step()
    opt = dmuon_ds.dmuon_of(engine)
    if opt.mode == "owner":
        opt.engine.exchange.wait_all_published()  # the last broadcasts, before reading
    return full_params(engine.module)


def _save_and_resume(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from dmuon.integrations import deepspeed as dmuon_ds

    out: dict = {}
    after = range(SAVED_AT, SAVED_AT + AFTER)
    for stage, mode in CASES:
        where = os.path.join(root, f"stage{stage}-{mode}")
        engine = _engine(stage, mode, world)
        _train(engine, range(SAVED_AT), rank, world)
        tag = dmuon_ds.save_checkpoint(engine, where, client_state={"data_step": SAVED_AT})
        straight = _train(engine, after, rank, world)

        resumed_engine = _engine(stage, mode, world)
        plain = None
        if stage > 0:  # DeepSpeed's own loader: refused before the scalars are loaded
            try:
                resumed_engine.load_checkpoint(where)
            except RuntimeError as e:
                plain = str(e)
        _, client_state = dmuon_ds.load_checkpoint(resumed_engine, where)  # tag from 'latest'
        resumed = _train(resumed_engine, after, rank, world)

        weights_only_engine = _engine(stage, mode, world)
        dmuon_ds.load_checkpoint(weights_only_engine, where, load_optimizer_states=False)
        weights_only = _train(weights_only_engine, after, rank, world)
        out[stage, mode] = {
            "tag": tag,
            "client_state": {
                k: v for k, v in client_state.items() if k == "data_step" or k == "optimizer"
            },
            "straight": straight,
            "resumed": resumed,
            "weights_only": weights_only,
            "plain": plain,
        }
        dist.barrier()

    # DMuon's part does not fit (another rule): refused before DeepSpeed's part is loaded.
    engine = _engine(2, "owner", world, rule="normuon")
    fresh = full_params(engine.module)
    try:
        dmuon_ds.load_checkpoint(engine, os.path.join(root, "stage2-owner"))
    except CheckpointMismatchError as e:
        out["mismatch"] = str(e)
    out["after_refusal"] = (engine.global_steps, max_diff(full_params(engine.module), fresh)[0])
    dist.barrier()

    # A checkpoint DeepSpeed wrote alone has no DMuon part: refused before any loading.
    engine = _engine(2, "owner", world)
    engine.save_checkpoint(os.path.join(root, "plain"), tag="only-deepspeed")
    try:
        dmuon_ds.load_checkpoint(engine, os.path.join(root, "plain"))
    except FileNotFoundError as e:
        out["no_dmuon_part"] = str(e)
    dist.barrier()
    return out


def _resume_alone(rank: int, world: int, root: str) -> dict:
    from dmuon.integrations import deepspeed as dmuon_ds

    out = {}
    for stage, mode in CASES:
        if stage != 0:  # ZeRO-1/2 load their partitions at the saved world size only
            continue
        engine = _engine(stage, mode, world)
        dmuon_ds.load_checkpoint(engine, os.path.join(root, f"stage{stage}-{mode}"))
        out[stage, mode] = _train(engine, range(SAVED_AT, SAVED_AT + AFTER), rank, world)
    return out


def test_deepspeed_checkpoints_resume_bitwise_and_reshard_dmuons_state(tmp_path):
    import_deepspeed()  # once here, before the ranks fork

    results = run_on_ranks(_save_and_resume, WORLD, args=(str(tmp_path),), timeout=900)
    for rank, out in enumerate(results):
        for stage, mode in CASES:
            r = out[stage, mode]
            assert r["tag"] == f"global_step{SAVED_AT}", r["tag"]
            assert r["client_state"] == {"data_step": SAVED_AT}  # (no rank-0 optimizer)
            diff, where = max_diff(r["resumed"], r["straight"])
            assert diff == 0.0, f"stage {stage} {mode}, rank {rank}: {where} differs by {diff:.2e}"
            control, _ = max_diff(r["weights_only"], r["straight"])
            assert control > 1e-4, f"stage {stage} {mode}: without the state the run was the same"
            if stage > 0:
                assert r["plain"] is not None, "engine.load_checkpoint dropped DMuon's state"
                assert "DMuon's matrix momentum" in r["plain"]
                assert "dmuon.integrations.deepspeed.load_checkpoint" in r["plain"]
        assert "saved by engine.save_checkpoint alone" in out["no_dmuon_part"]
        assert "rule" in out["mismatch"], out["mismatch"]
        assert out["after_refusal"] == (0, 0.0), "a refused load changed the engine"

    alone = run_on_ranks(_resume_alone, 1, args=(str(tmp_path),), timeout=600)[0]
    for case, params in alone.items():
        diff, where = max_diff(params, results[0][case]["straight"])
        assert diff <= TOLERANCE, f"stage 0 {case[1]} at 1 rank: {where} differs by {diff:.2e}"
