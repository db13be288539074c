"""A damaged or half-visible DCP checkpoint is refused on every rank, changing nothing.

* A data file cut short (a full disk, a copy that stopped): DCP's own error is a
  ``BaseException`` that ``except Exception`` fallbacks miss, and it came after the model's
  weights had been read in place — the job held the checkpoint's weights with the
  optimizer state from before. Now :class:`~dmuon.integrations.checkpoint.CheckpointReadError`
  on every rank, the model and optimizer as they were, and training goes on.
* A ``.metadata`` only some ranks see (a node-local copy, a file system that has not caught
  up): the ranks that saw it waited in DCP's first collective for the process group's
  timeout. Now every rank raises ``FileNotFoundError``, the others naming the rank.
* A garbage ``.metadata``: named (it was a bare ``UnpicklingError``).
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import checkpoint
from dmuon.integrations.checkpoint import CheckpointReadError
from dmuon.optim import DMuon, param_groups


def _setup():
    from dmuon.integrations import ddp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02, timeout=20)
    return model, opt, ded


def _step(model, opt, t):
    g = torch.Generator().manual_seed(10 * t + torch.distributed.get_rank())
    F.mse_loss(model(torch.randn(4, 6, generator=g)), torch.zeros(4, 3)).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt, ded):
    ded.wait()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    return weights, state


def _same(a, b) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def _save(rank, world, path):
    model, opt, _ = _setup()
    _step(model, opt, 0)
    checkpoint.save(path, model, opt)


def _load(rank, world, paths):
    model, opt, ded = _setup()
    _step(model, opt, 1)  # live state that a refused load must leave alone
    before = _snapshot(model, opt, ded)
    try:
        checkpoint.load(paths[rank], model, opt)
        outcome = None
    except Exception as err:  # CheckpointReadError, FileNotFoundError: an Exception
        outcome = (type(err).__name__, str(err))
    unchanged = _same(before, _snapshot(model, opt, ded))
    _step(model, opt, 2)  # training goes on
    return outcome, unchanged


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "step-1")
    run_on_ranks(_save, 2, args=(path,), timeout=90)
    return path


def _damaged(saved: str, name: str, damage) -> str:
    path = saved + "-" + name
    shutil.copytree(saved, path)
    damage(path)
    return path


def test_a_truncated_data_file_changes_nothing_on_any_rank(saved):
    def cut(path):
        last = sorted(glob.glob(os.path.join(path, "*.distcp")))[-1]
        with open(last, "r+b") as f:
            f.truncate(os.path.getsize(last) - 40)

    path = _damaged(saved, "cut", cut)
    for rank, (outcome, unchanged) in enumerate(
        run_on_ranks(_load, 2, args=([path, path],), timeout=120)
    ):
        assert outcome is not None and outcome[0] == "CheckpointReadError", (rank, outcome)
        assert "nothing was changed" in outcome[1] and repr(path) in outcome[1], outcome
        assert unchanged, f"rank {rank}: the refused load changed the model or optimizer"


def test_metadata_missing_on_one_rank_is_named_on_every_rank(saved):
    copy = _damaged(saved, "local", lambda p: os.remove(os.path.join(p, ".metadata")))
    outcomes = run_on_ranks(_load, 2, args=([saved, copy],), timeout=120)
    (zero, unchanged0), (one, unchanged1) = outcomes
    assert unchanged0 and unchanged1
    assert zero is not None and zero[0] == "FileNotFoundError" and "rank(s) [1]" in zero[1], zero
    assert one is not None and one[0] == "FileNotFoundError" and "no .metadata" in one[1], one


def test_a_garbage_metadata_file_is_named(saved):
    def garble(path):
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(b"garbage")

    path = _damaged(saved, "garbled", garble)
    for rank, (outcome, unchanged) in enumerate(
        run_on_ranks(_load, 2, args=([path, path],), timeout=120)
    ):
        assert outcome is not None and outcome[0] == "CheckpointReadError", (rank, outcome)
        assert ".metadata" in outcome[1] and unchanged, (rank, outcome)


def test_the_read_error_is_an_exception():
    assert issubclass(CheckpointReadError, Exception)


# ---------------------------------------------- one process: what the checks must name


def _one_process(**group_options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    groups = param_groups(model)
    groups[0].update(group_options)
    opt = DMuon(groups, rule="normuon", lr=0.02)
    F.mse_loss(model(torch.randn(4, 6)), torch.zeros(4, 4)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_a_group_saved_with_another_layout_is_refused_by_name(tmp_path):
    """The state's shapes follow ``transposed``/``num_heads``/...: a checkpoint of another
    layout was refused by a shape mismatch, or accepted when the shapes coincided."""
    path = str(tmp_path / "heads")
    checkpoint.save(path, *_one_process(num_heads=2))
    model, opt = _one_process()
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"saved with num_heads=2"):
        checkpoint.load(path, model, opt)
    path = str(tmp_path / "transposed")
    checkpoint.save(path, *_one_process(transposed=True))
    model, opt = _one_process()
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"saved with transposed=True"):
        checkpoint.load(path, model, opt)


def test_a_full_state_dict_with_integer_state_is_refused_before_anything_changes():
    """The load cast it: an int64 momentum of magnitude 1e-2 became zeros."""
    model, opt = _one_process()
    sd = checkpoint.full_state_dict(model, opt)
    name = next(iter(sd["optim"]["state"]))
    key = next(k for k in sd["optim"]["state"][name] if k != "step")
    sd["optim"]["state"][name][key] = sd["optim"]["state"][name][key].long()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"torch.int64 in the checkpoint"):
        checkpoint.load_full_state_dict(model, opt, sd)
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("keep", [16, 3000])
def test_a_data_file_cut_before_the_small_entries_is_a_read_error_in_load_and_check(tmp_path, keep):
    """The first read (param groups, extra) failed with DCP's BaseException too."""
    path = str(tmp_path / "cut")
    checkpoint.save(path, *_one_process())
    for f in glob.glob(os.path.join(path, "*.distcp")):
        with open(f, "r+b") as fh:
            fh.truncate(keep)
    model, opt = _one_process()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for call in (checkpoint.check, checkpoint.load):
        with pytest.raises(CheckpointReadError, match="nothing was changed"):
            call(path, model, opt)
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
