"""What a checkpoint keeps besides the tensors, and the names it keeps them under.

* ``extra`` comes back as it was passed, whatever its shape (lists of tensors, keys
  that are digits or hold dots: DCP flattened it by key, and ``load`` rebuilt it wrongly
  or failed), and one value for the job: rank 0's, with a warning on each rank whose
  value differs from rank 0's, naming the keys (DCP kept an arbitrary rank's, silently).
* The optimizer's state is named as ``get_model_state_dict`` names the model's, without
  ``torch.compile``'s ``_orig_mod`` and activation checkpointing's wrapper, so a run
  saved with either resumes without it and the other way round (both halves are checked
  against the one-process run that never saved).
* ``load_full_state_dict`` loads the model's own keys, as DCP's ``load`` does: a saved
  entry the model no longer has no longer fails after the weights were written.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import checkpoint
from dmuon.optim import DMuon, param_groups

OPT = {"lr": 0.02, "adamw_lr": 0.01, "weight_decay": 0.01}


def _mlp(seed: int = 0, buffer: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    if buffer:
        model.register_buffer("mask", torch.ones(8))
    return model


def _step(model: nn.Module, opt: DMuon, t: int) -> None:
    g = torch.Generator().manual_seed(100 + t)
    model(torch.randn(6, 4, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_extra_comes_back_as_it_was_passed(tmp_path):
    model = _mlp()
    opt = DMuon(param_groups(model), **OPT)
    _step(model, opt, 0)
    rng = [torch.get_rng_state(), torch.arange(3)]
    extra = {
        "step": 7,
        "rng": rng,  # a list of tensors: load failed (a list indexed by a string)
        "by_rank": {"0": "a", "1": "b"},  # digit keys: came back a list, then failed
        "data.epoch": 3,  # a dotted key: came back as {"data": {"epoch": 3}}
        "sched": torch.optim.lr_scheduler.StepLR(opt, 2).state_dict(),
        "empty": {},
    }
    checkpoint.save(tmp_path, model, opt, extra=extra)
    fresh = _mlp(seed=1)
    got = checkpoint.load(tmp_path, fresh, DMuon(param_groups(fresh), **OPT))
    assert set(got) == set(extra)
    assert torch.equal(got["rng"][0], rng[0]) and torch.equal(got["rng"][1], rng[1])
    assert got["by_rank"] == {"0": "a", "1": "b"}
    assert got["data.epoch"] == 3 and got["step"] == 7 and got["empty"] == {}
    assert got["sched"] == extra["sched"]


def run_save_extra(rank, world, path, rank_0_only):
    """Owner mode on 2 ranks saves with ``extra`` (each rank's own, or rank 0's alone) and
    loads it back: what ``load`` returned and the warnings of the save."""
    from dmuon.integrations import ddp

    model = _mlp()
    opt = DMuon(param_groups(model), distributed=ddp.dedicate(model), **OPT)
    _step(model, opt, 0)
    extra = ({"step": 3} if rank == 0 else None) if rank_0_only else {"step": 3, "rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(path, model, opt, extra=extra)
    return checkpoint.load(path, model, opt), [str(w.message) for w in caught]


def test_an_extra_that_differs_between_ranks_is_rank_0s_with_a_warning(tmp_path):
    results = run_on_ranks(run_save_extra, 2, args=(str(tmp_path), False), timeout=120)
    for rank, (got, caught) in enumerate(results):
        warned = [w for w in caught if "differs from rank 0's" in w]
        assert got == {"step": 3, "rank": 0}, (rank, got)
        if rank == 1:  # the rank whose value the checkpoint does not keep
            assert len(warned) == 1, warned
            assert "extra['rank'] on rank 1 differs from rank 0's" in warned[0], warned
        else:
            assert warned == [], warned


def _wrapped(how: str, model: nn.Module) -> nn.Module:
    if how == "compile":
        return torch.compile(model)  # an OptimizedModule: names under _orig_mod
    if how == "checkpoint":
        model[2] = checkpoint_wrapper(model[2])
        return model
    return model


@pytest.mark.parametrize("how", ["compile", "checkpoint"])
@pytest.mark.parametrize("form", ["dcp", "full"])
@pytest.mark.parametrize("direction", ["saved wrapped", "loaded wrapped"])
def test_a_checkpoint_does_not_depend_on_wrappers(tmp_path, how, form, direction):
    """Train 2 steps, save, resume in a fresh model and train 2 more: equal to 4 steps
    without a save, with the wrapper on the saving side or on the loading side only. The
    steps run through the inner model (a compiled forward is not the point here)."""
    reference = _mlp()
    ref_opt = DMuon(param_groups(reference), **OPT)
    for t in range(4):
        _step(reference, ref_opt, t)

    inner = _mlp()
    model = _wrapped(how, inner) if direction == "saved wrapped" else inner
    opt = DMuon(param_groups(model), **OPT)
    for t in range(2):
        _step(inner, opt, t)
    full = checkpoint.full_state_dict(model, opt) if form == "full" else None
    if form == "dcp":
        checkpoint.save(tmp_path, model, opt)

    fresh_inner = _mlp(seed=1)
    fresh = _wrapped(how, fresh_inner) if direction == "loaded wrapped" else fresh_inner
    fresh_opt = DMuon(param_groups(fresh), **OPT)
    if form == "dcp":
        checkpoint.load(tmp_path, fresh, fresh_opt)
    else:
        checkpoint.load_full_state_dict(fresh, fresh_opt, full)
    for t in range(2, 4):
        _step(fresh_inner, fresh_opt, t)
    for (name, want), got in zip(
        reference.named_parameters(), fresh_inner.parameters(), strict=True
    ):
        assert torch.equal(got, want), name


def test_a_full_state_dict_entry_the_model_no_longer_has_is_left(tmp_path):
    """A buffer dropped since the save: DCP's load leaves it, and so does the one-file
    load (it raised torch's strict-load error after the weights were written)."""
    model = _mlp(buffer=True)
    opt = DMuon(param_groups(model), **OPT)
    _step(model, opt, 0)
    full = checkpoint.full_state_dict(model, opt)
    fresh = _mlp(seed=1)
    fresh_opt = DMuon(param_groups(fresh), **OPT)
    checkpoint.load_full_state_dict(fresh, fresh_opt, full)
    for (name, want), got in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(got, want), name
    _step(model, opt, 1)
    _step(fresh, fresh_opt, 1)  # the optimizer's state was loaded too
    for (name, want), got in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(got, want), name


def run_different_checkpoints(rank, world, root):
    from dmuon.integrations import ddp
    from dmuon.integrations.checkpoint import CheckpointMismatchError

    model = _mlp()
    opt = DMuon(param_groups(model), distributed=ddp.dedicate(model), **OPT)
    _step(model, opt, 0)
    checkpoint.save(f"{root}/step_1", model, opt)
    _step(model, opt, 1)
    checkpoint.save(f"{root}/step_2", model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    # each rank's "latest" differs (a filesystem not shared alike)
    mine = f"{root}/step_{1 + rank}"
    errors = []
    for call in (checkpoint.check, checkpoint.load):
        try:
            call(mine, model, opt)
        except CheckpointMismatchError as err:
            errors.append(str(err))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    checkpoint.load(f"{root}/step_1", model, opt)  # the same one everywhere: loads
    return errors, unchanged


def test_ranks_that_read_different_checkpoints_are_refused_on_every_rank(tmp_path):
    """DCP read each rank's own directory and the job went on from two saves (rank 0 at
    step 1, rank 1 at step 2): each save has an id, and a load (and ``check``) whose ranks
    read different ones raises on every rank before anything changes."""
    results = run_on_ranks(run_different_checkpoints, 2, args=(str(tmp_path),), timeout=120)
    for rank, (errors, unchanged) in enumerate(results):
        assert len(errors) == 2, (rank, errors)
        assert all("the ranks read different checkpoints" in e for e in errors), errors
        assert f"step_{1 + rank}" in errors[0], errors
        assert unchanged, rank


def test_extra_passed_on_rank_0_only_is_every_ranks():
    """The DDP habit: only rank 0 passes ``extra``. Every rank enters the extra's
    agreement (it hung when only rank 0 did), takes rank 0's silently, and loads it."""
    import tempfile

    path = tempfile.mkdtemp()
    for rank, (got, warned) in enumerate(
        run_on_ranks(run_save_extra, 2, args=(path, True), timeout=120)
    ):
        assert got == {"step": 3}, (rank, got)
        assert not [w for w in warned if "extra" in w], warned


def test_a_checkpoint_with_extra_in_the_earlier_layout_still_loads_it(tmp_path):
    """Checkpoints written before ``extra`` was one value hold it flattened by DCP
    (``extra.step``, ``extra.sched.last_epoch``, a tensor under ``extra.rng``): ``load``
    reads it back from those keys (it returned ``{}``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dmuon.integrations.checkpoint.dcp import describe_optimizer
    from dmuon.integrations.checkpoint.holders import holdings, release, settle
    from dmuon.integrations.checkpoint.sharded_state import state_to_save

    model = _mlp()
    opt = DMuon(param_groups(model), **OPT)
    _step(model, opt, 0)
    held = holdings(model, opt)
    settle(opt)
    try:  # what save() wrote then: extra a dict beside the rest, no save id
        rng = torch.arange(4)
        old = {"step": 7, "sched": {"last_epoch": 7}, "rng": rng}
        state = {
            "model": get_model_state_dict(model),
            "optim": state_to_save(opt, held),
            "dmuon": describe_optimizer(opt),
            "extra": old,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "assumes a single process"
            dcp.save(state, checkpoint_id=str(tmp_path))
    finally:
        release(opt)
    fresh = _mlp(seed=1)
    got = checkpoint.load(tmp_path, fresh, DMuon(param_groups(fresh), **OPT))
    assert got.keys() == old.keys() and got["step"] == 7 and got["sched"] == {"last_epoch": 7}
    assert torch.equal(got["rng"], rng)
