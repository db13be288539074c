"""Weights stored ``(in, out)`` (Hugging Face's ``Conv1D``, the group key ``transposed``) in
every distributed mode: the parameters of one process on the same global batch.

GPT-2-like blocks of ``Conv1D`` layers (``distributed_cases.Conv1DModel``: a fused
``c_attn`` that ``param_groups`` splits into q|k|v, square and non-square matrices), with
rules that read the orientation — NorMuon's per-row second moment and the ``"spectral"``
convention's √(fan_out/fan_in) — on 2 gloo ranks: owner mode under FSDP2 and as a DDP
replacement, replicated mode under DDP, sharded mode under FSDP2 (whose rows of an
``(in, out)`` weight are its input features). Tolerance 1e-5, as in
``test_modes_equal_single.py``.
"""

import pytest
from distributed_cases import (
    OPT,
    STEPS,
    TOLERANCE,
    build,
    full_params,
    max_diff,
    reference,
    run_modes,
)

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import param_groups

MODES = ["owner_fsdp", "owner_ddp", "replicated", "sharded"]
WORLD = 2


def test_param_groups_marks_the_conv1d_weights_and_splits_c_attn():
    groups = param_groups(build("conv1d"))
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert by_name["blocks.0.attn.c_attn.weight"]["split_sizes"] == (8, 8, 8)
    for n in ("attn.c_attn", "attn.c_proj", "c_fc", "c_out"):
        assert by_name[f"blocks.1.{n}.weight"]["transposed"] is True
    assert not by_name["stem.weight"].get("transposed")


@pytest.mark.parametrize("rule", ["normuon", "muon"])
def test_transposed_weights_in_every_mode_equal_one_process(rule):
    opt_kw = dict(OPT, rule=rule, adjust_lr="spectral")
    expected = reference("conv1d", WORLD, opt_kw=opt_kw)
    moved, _ = max_diff(expected, full_params(build("conv1d")))
    assert moved > 1e-2, "the reference barely trained: the comparison would prove nothing"
    results = run_on_ranks(
        run_modes, WORLD, args=("conv1d", MODES, STEPS), kwargs={"opt_kw": opt_kw}, timeout=180
    )
    for mode in MODES:
        for rank in range(WORLD):
            diff, where = max_diff(results[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"
            same, where = max_diff(results[rank][mode], results[0][mode])
            assert same == 0.0, f"{mode}: rank {rank} and rank 0 differ at {where}"


def run_transposed_shards(rank, world):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dmuon.optim import DMuon

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for dim in (0, 1):  # an (in, out) weight split by input rows or by output columns
        p = nn.Parameter(distribute_tensor(torch.ones(6, 8), mesh, [Shard(dim)]))
        try:
            DMuon([{"params": [p], "transposed": True}], mode="single", **OPT)
        except ValueError as err:
            out.append(str(err))
        else:
            out.append(None)
    return out


def test_a_tensor_parallel_transposed_weight_is_refused_on_every_rank():
    """A split names a dimension of the stored ``(in, out)`` weight, which the rule sees
    transposed: stepping it would all-reduce the wrong Gram matrix. Refused, clearly."""
    for rank, errors in enumerate(run_on_ranks(run_transposed_shards, WORLD, timeout=60)):
        for err in errors:
            assert err is not None and "stored (in, out)" in err and "tensor-parallel" in err, (
                rank,
                err,
            )


CHECKPOINT_MODES = ["owner_fsdp", "owner_ddp", "sharded"]
SAVE_AT, TOTAL = 2, 4
CHECKPOINT_OPT = dict(OPT, rule="normuon", adjust_lr="spectral")


def _train(forward, opt, rank, world, start, stop):
    from distributed_cases import batch, loss_of

    for t in range(start, stop):
        loss_of("conv1d", forward, *batch("conv1d", t, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def run_checkpoint(rank, world, root):
    """Per mode: train TOTAL steps saving a DCP checkpoint after SAVE_AT (the uninterrupted
    run), then a fresh model and optimizer load it and train to TOTAL."""
    import os

    import torch.distributed as dist
    from distributed_cases import setup

    from dmuon.integrations import checkpoint

    out = {}
    for mode in CHECKPOINT_MODES:
        path = os.path.join(root, mode)
        runs = []
        for resume in (False, True):
            model, forward, opt, ded = setup(mode, "conv1d", world, CHECKPOINT_OPT)
            if resume:
                start = checkpoint.load(path, model, opt)["step"]
            else:
                _train(forward, opt, rank, world, 0, SAVE_AT)
                checkpoint.save(path, model, opt, extra={"step": SAVE_AT})
                start = SAVE_AT
            _train(forward, opt, rank, world, start, TOTAL)
            if ded is not None:
                ded.wait()
            runs.append(full_params(model))
            dist.barrier()
        out[mode] = runs
    return out


def test_dcp_checkpoint_of_transposed_weights_resumes_exactly(tmp_path):
    """A DCP checkpoint of a Conv1D model (state in the parameter's ``(in, out)`` shape,
    NorMuon's per-row state one value per output) resumes at the same world size as the
    uninterrupted run, bit for bit, in owner mode under FSDP2 and as a DDP replacement and
    in sharded mode; and into one process within the modes' tolerance."""
    from distributed_cases import setup

    from dmuon.integrations import checkpoint

    results = run_on_ranks(run_checkpoint, WORLD, args=(str(tmp_path),), timeout=240)
    for mode in CHECKPOINT_MODES:
        for rank in range(WORLD):
            straight, resumed = results[rank][mode]
            diff, where = max_diff(resumed, straight)
            assert diff == 0.0, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"
        model, forward, opt, _ = setup("single", "conv1d", 1, CHECKPOINT_OPT)
        start = checkpoint.load(str(tmp_path / mode), model, opt)["step"]
        _train(forward, opt, 0, 1, start, TOTAL)
        diff, where = max_diff(full_params(model), results[0][mode][0])
        assert diff <= TOLERANCE, f"{mode} into one process: {where} off by {diff:.2e}"
