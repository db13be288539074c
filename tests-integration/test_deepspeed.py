"""DeepSpeed with DMuon as client optimizer reaches the single-process parameters.

For each (ZeRO stage, mode) of ``dmuon.integrations.deepspeed.SUPPORTED`` (stage 0 in
replicated and in owner mode, stages 1 and 2 in owner mode), a small GPT (benchmarks/common) is
trained 5 steps by a DeepSpeed engine on 2 gloo ranks, each rank on its half of the
global batch — once in one micro-batch per step, once in two accumulated ones
(DeepSpeed's ``gradient_accumulation_steps``); the reference trains the same model in
this process with ``DMuon(param_groups(model))`` on the mean of the two halves' losses. The same
rank processes then ask for every refused combination (stage 3, replicated at stage 1/2,
an unknown mode, bf16, gradient clipping in owner mode) and must raise
``UnsupportedConfigError`` on every rank, without a collective that could hang. One
launch runs all of it: DeepSpeed's import and its first ``initialize`` (it builds its
shared-memory comm op on the CPU accelerator, cached afterwards) are paid once.

Tolerance 1e-5 (fp32 Newton–Schulz, AdamW ε = 1e-3 as in distributed_cases): the
runs differ only in the order of the gradient sums.

The guide's script (docs/guides/deepspeed.md) is run as written, under torchrun.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from deepspeed_cases import CASES, deepspeed_config, import_deepspeed, needs_deepspeed
from distributed_cases import (
    OPT,
    STEPS,
    TOLERANCE,
    batch,
    build,
    full_params,
    loss_of,
    max_diff,
    reference,
)
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import deepspeed as dmuon_ds
from dmuon.optim import DMuon, param_groups

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLD = 2
SUPPORTED_TEXT = (
    "stage 0 (mode='replicated' or 'owner'), stage 1 (mode='owner'), stage 2 (mode='owner')"
)
ONE_LR = "would set every param group's lr to the same warmup_max_lr"
REFUSED = [  # (stage, mode, extra config, what the message must say)
    (3, None, {}, SUPPORTED_TEXT),
    (1, "replicated", {}, SUPPORTED_TEXT),
    (2, "replicated", {}, SUPPORTED_TEXT),
    (1, "sharded", {}, SUPPORTED_TEXT),
    (2, None, {"bf16": {"enabled": True}}, SUPPORTED_TEXT),
    (2, None, {"gradient_clipping": 1.0}, "gradient_clipping is not supported at ZeRO stage 2"),
    (0, "owner", {"managed_gradient_accumulation": False}, "managed_gradient_accumulation=false"),
    (2, None, {"zero_optimization": {"stage": 2, "elastic_checkpoint": True}}, "elastic_ch"),
    (1, None, {"scheduler": {"type": "WarmupLR"}}, "'scheduler' section is not supported at"),
    # one warmup_max_lr for every group, where lr and adamw_lr differ (OPT): refused at
    # stage 0 too, where DeepSpeed's scheduler reaches every group
    *(
        (0, mode, {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02}}}, ONE_LR)
        for mode in ("replicated", "owner")
    ),
]
# Training loops that decide per micro-batch whether it ends the step: (name, stage, accumulate)
LOOPS = [
    ("boundary set before backward", 2, 2),  # what Accelerate does: after the forward
    ("boundary set before backward", 0, 2),
    ("DMuon's no_sync", 0, 1),  # the first half-batch's backward inside reduction.no_sync()
    ("DeepSpeed's no_sync", 0, 1),  # ... inside engine.no_sync()
]
ACCUMULATE = 2  # micro-batches per step in the accumulation cases (every case runs both)
CLIPPED = [(0, "replicated"), (0, "owner")]  # where gradient_clipping is served
MAX_NORM = 0.05  # below this model's gradient norms: the clipping is active


def clipped_reference(world: int) -> dict:
    """``reference`` with ``torch.nn.utils.clip_grad_norm_`` of the global gradient."""
    torch.manual_seed(0)
    model = build("gpt")
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        losses = [loss_of("gpt", model, *batch("gpt", t, r, world)) for r in range(world)]
        (sum(losses) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return full_params(model)


def _train_and_refuse(rank: int, world: int):
    import torch.distributed as dist

    params, modes = {}, {}
    for (stage, mode), accumulate in itertools.product(CASES, (1, ACCUMULATE)):
        model = build("gpt")
        config = deepspeed_config(stage, world, accumulate)
        engine, _, _, _ = dmuon_ds.initialize(model, config, mode=mode, **OPT)
        for t in range(STEPS):
            x, y = batch("gpt", t, rank, world)  # this rank's rows, in `accumulate` pieces
            for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
                engine.backward(loss_of("gpt", engine, xm, ym))  # DeepSpeed scales by 1/acc.
                engine.step()  # the optimizer steps at the boundary only
        opt = dmuon_ds.dmuon_of(engine)
        if opt.mode == "owner":
            opt.engine.exchange.wait_all_published()  # the last broadcasts, before reading
        # owner mode at stage 0 replaces DeepSpeed's all-reduce (it would repeat the traffic)
        modes[stage, mode, accumulate] = (opt.mode, engine.enable_backward_allreduce)
        params[stage, mode, accumulate] = full_params(model)
        dist.barrier()
    for name, stage, accumulate in LOOPS:
        model = build("gpt")
        engine, _, _, _ = dmuon_ds.initialize(
            model, deepspeed_config(stage, world, accumulate), mode="owner", **OPT
        )
        exchange = dmuon_ds.dmuon_of(engine).engine.exchange
        for t in range(STEPS):
            x, y = batch("gpt", t, rank, world)
            halves = list(zip(x.chunk(2), y.chunk(2), strict=True))
            for i, (xm, ym) in enumerate(halves):
                last = i == len(halves) - 1
                loss = loss_of("gpt", engine, xm, ym)
                if name == "boundary set before backward":
                    engine.set_gradient_accumulation_boundary(last)
                    engine.backward(loss)
                    engine.step()
                    continue
                hold = (
                    exchange.reduction.no_sync() if name == "DMuon's no_sync" else engine.no_sync()
                )
                with contextlib.nullcontext() if last else hold:
                    engine.backward(loss / 2)  # two halves, one step: their mean
            if name != "boundary set before backward":
                engine.step()
        exchange.wait_all_published()
        params[name, stage, accumulate] = full_params(model)
        dist.barrier()
    for stage, mode in CLIPPED:
        model = build("gpt")
        config = deepspeed_config(stage, world, gradient_clipping=MAX_NORM)
        engine, _, _, _ = dmuon_ds.initialize(model, config, mode=mode, **OPT)
        for t in range(STEPS):
            engine.backward(loss_of("gpt", engine, *batch("gpt", t, rank, world)))
            engine.step()
        opt = dmuon_ds.dmuon_of(engine)
        if opt.mode == "owner":
            opt.engine.exchange.wait_all_published()
        params[stage, mode, "clipped"] = full_params(model)
        dist.barrier()
    refusals = []
    for stage, mode, extra, _ in REFUSED:
        try:
            config = deepspeed_config(stage, world, **extra)
            dmuon_ds.initialize(build("gpt"), config, mode=mode, **OPT)
        except dmuon_ds.UnsupportedConfigError as e:
            refusals.append(str(e))
        else:
            refusals.append(None)
    dist.barrier()  # every rank got here: no refusal left a rank inside a collective
    return params, modes, refusals


@needs_deepspeed
def test_supported_stages_equal_single_process_and_refused_ones_raise_on_every_rank():
    import_deepspeed()  # once here, before the ranks fork

    expected = reference("gpt", WORLD)
    moved, _ = max_diff(expected, full_params(build("gpt")))
    assert moved > 1e-2, "the reference barely trained: the comparison would prove nothing"
    clipped = clipped_reference(WORLD)
    assert max_diff(clipped, expected)[0] > 1e-4, "MAX_NORM does not clip: the test is void"
    results = run_on_ranks(_train_and_refuse, WORLD, timeout=900)
    for rank, (params, modes, refusals) in enumerate(results):
        expected_modes = {(s, m, a): (m, not (s == 0 and m == "owner")) for s, m, a in modes}
        assert modes == expected_modes and len(modes) == 2 * len(CASES)
        for case in LOOPS:
            diff, where = max_diff(params[case], expected)
            assert diff <= TOLERANCE, f"{case}, rank {rank}: {where} differs by {diff:.2e}"
        for stage, mode in CLIPPED:
            diff, where = max_diff(params[stage, mode, "clipped"], clipped)
            assert diff <= TOLERANCE, f"clipped {stage} {mode}, rank {rank}: {where} by {diff:.2e}"
        for case in modes:
            diff, where = max_diff(params[case], expected)
            assert diff <= TOLERANCE, f"{case}, rank {rank}: {where} differs by {diff:.2e}"
            same, where = max_diff(params[case], results[0][0][case])
            assert same == 0.0, f"{case}: rank {rank} and rank 0 differ at {where}"
        for (stage, mode, extra, says), message in zip(REFUSED, refusals, strict=True):
            assert message is not None, f"rank {rank}: stage {stage}, mode {mode}, {extra} ran"
            assert says in message, message


LOUD = 50.0  # the loss scaled so that the gradient norm exceeds DeepSpeed's default 1.0


def loud_reference(world: int, max_norm: float | None) -> dict:
    """``reference`` on ``LOUD`` times the loss, clipped to ``max_norm`` (torch's) or not."""
    torch.manual_seed(0)
    model = build("gpt")
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        losses = [loss_of("gpt", model, *batch("gpt", t, r, world)) for r in range(world)]
        (LOUD * sum(losses) / world).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return full_params(model)


def _without_clipping_key(rank: int, world: int) -> dict:
    import torch.distributed as dist

    params = {}
    for stage, mode in [(0, "replicated"), (0, "owner"), (2, "owner")]:
        model = build("gpt")
        config = deepspeed_config(stage, world)  # no "gradient_clipping": DeepSpeed's 1.0
        engine, _, _, _ = dmuon_ds.initialize(model, config, mode=mode, **OPT)
        for t in range(STEPS):
            engine.backward(LOUD * loss_of("gpt", engine, *batch("gpt", t, rank, world)))
            engine.step()
        opt = dmuon_ds.dmuon_of(engine)
        if opt.mode == "owner":
            opt.engine.exchange.wait_all_published()
        params[stage, mode] = full_params(model)
        dist.barrier()
    return params


@needs_deepspeed
def test_a_config_without_gradient_clipping_gets_deepspeeds_default_where_it_is_served():
    """DeepSpeed clips at 1.0 when the key is absent. Stage 0 serves it in both modes (owner
    mode: DMuon's global-norm clip; before, owner mode did not clip at all). At stage 1/2
    ZeRO would clip the scalars by their own norm (refused when asked for): DMuon turns the
    default off there, and the run equals one process without clipping (before, it equalled
    neither)."""
    import_deepspeed()  # once here, before the ranks fork
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    clipped = loud_reference(WORLD, GRADIENT_CLIPPING_DEFAULT)
    free = loud_reference(WORLD, None)
    assert max_diff(clipped, free)[0] > 1e-4, "the default clip does not bind: the test is void"
    for rank, params in enumerate(run_on_ranks(_without_clipping_key, WORLD, timeout=600)):
        for case, want in [
            ((0, "replicated"), clipped),
            ((0, "owner"), clipped),
            ((2, "owner"), free),
        ]:
            diff, where = max_diff(params[case], want)
            assert diff <= TOLERANCE, f"{case}, rank {rank}: {where} differs by {diff:.2e}"


def test_check_config_names_the_stage_and_the_supported_ones():
    assert dmuon_ds.check_config({"zero_optimization": {"stage": 1}}) == (1, "owner")
    assert dmuon_ds.check_config({}) == (0, "replicated")
    with pytest.raises(dmuon_ds.UnsupportedConfigError, match="ZeRO stage 3 is not supported"):
        dmuon_ds.check_config({"zero_optimization": {"stage": 3}})
    with pytest.raises(dmuon_ds.UnsupportedConfigError, match="gradient_clipping"):
        dmuon_ds.check_config({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0})
    with pytest.raises(dmuon_ds.UnsupportedConfigError, match="'optimizer' section"):
        dmuon_ds.check_config({"optimizer": {"type": "AdamW"}})
    scheduled = {"scheduler": {"type": "WarmupLR"}}
    assert dmuon_ds.check_config({"zero_optimization": {"stage": 0}, **scheduled}, "owner")
    with pytest.raises(dmuon_ds.UnsupportedConfigError, match="dmuon_of\\(engine\\)"):
        dmuon_ds.check_config({"zero_optimization": {"stage": 2}, **scheduled})
    # an empty section is no scheduler (DeepSpeed needs its type)
    assert dmuon_ds.check_config({"zero_optimization": {"stage": 2}, "scheduler": {}})
    with pytest.raises(dmuon_ds.UnsupportedConfigError, match="resolve it before"):
        dmuon_ds.check_config({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"})
    # DeepSpeed's older spellings, which it still reads: refused as the new ones are
    with pytest.raises(dmuon_ds.UnsupportedConfigError, match=r"bfloat16\.enabled"):
        dmuon_ds.check_config({"bfloat16": {"enabled": True}})
    with pytest.raises(dmuon_ds.UnsupportedConfigError, match=r"zero_optimization\.cpu_offload"):
        dmuon_ds.check_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})


def run_refused_then_corrected(rank: int, world: int, stage: int) -> list[str]:
    """A refused owner-mode initialize (a bad DMuon option, a bad dedicate option, a
    batch size DeepSpeed refuses), then the corrected call on the same model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}
    config["zero_optimization"] = {"stage": stage}
    seen = []
    for bad_options, bad_config in [
        ({"momentum": 2.0}, {}),
        ({"dedicate_options": {"reshard_after_forward": True} if stage else {"no_such": 1}}, {}),
        ({}, {"train_batch_size": 6}),
    ]:
        try:
            dmuon_ds.initialize(
                model, {**config, **bad_config}, mode="owner", lr=0.02, **bad_options
            )
            seen.append("accepted")
        except Exception as err:
            seen.append(f"{type(err).__name__}: {err}")
    engine, *_ = dmuon_ds.initialize(model, config, mode="owner", lr=0.02)
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    return seen


@needs_deepspeed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 2])
def test_a_refused_owner_initialize_leaves_the_model_to_a_corrected_call(stage):
    # before: the refused call left the model dedicated, and the corrected one raised
    # "parameter '0.weight' is dedicated twice"; stage 2 handed dedicate_options it
    # does not take to plan_owners (TypeError)
    for seen in run_on_ranks(run_refused_then_corrected, 2, args=(stage,), timeout=200):
        assert "momentum" in seen[0], seen
        if stage:
            assert (
                "dedicate_options ['reshard_after_forward'] are not taken at ZeRO stage 2"
                in seen[1]
            ), seen
        else:  # not an option of ddp.dedicate: refused by Python before any dedication
            assert "no_such" in seen[1], seen
        assert seen[2] != "accepted" and "dedicated twice" not in seen[2], seen


def _guide_script() -> str:
    text = (ROOT / "docs" / "guides" / "deepspeed.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/guides/deepspeed.md has no python block"
    return blocks[0]


@needs_deepspeed
def test_the_guide_script_trains_under_torchrun(tmp_path):
    script = tmp_path / "train_deepspeed.py"
    script.write_text(_guide_script())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *map(str, sorted((ROOT / "packages").glob("*/src"))), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD)]
    cmd += ["--standalone", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", proc.stdout, flags=re.M)]
    assert len(losses) >= 2, proc.stdout[-2000:]
    assert losses[-1] < losses[0], losses
    assert "DMuon mode: owner" in proc.stdout  # the guide's config is ZeRO-2


def test_dmuon_integrations_imports_without_deepspeed():
    # deepspeed made unimportable: dmuon.integrations and its config check still work, and
    # initialize() says what to install.
    code = """
import sys
sys.modules["deepspeed"] = None
from dmuon.integrations import deepspeed as dmuon_ds
assert dmuon_ds.check_config({"zero_optimization": {"stage": 1}}) == (1, "owner")
try:
    dmuon_ds.initialize(None, {})
except ImportError as e:
    print("ImportError:", e)
"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(map(str, sorted((ROOT / "packages").glob("*/src"))))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ImportError: dmuon.integrations.deepspeed needs DeepSpeed" in proc.stdout
