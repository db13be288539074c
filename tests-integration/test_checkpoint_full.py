"""The single-file full state dict, and the errors a checkpoint that does not fit raises.

Round trip: the small GPT trains 2 steps at 2 ranks in owner mode (a DDP
replacement whose scalar parameters are owned too: sharded AdamW state), rank 0
gathers ``full_state_dict`` and the run goes on to step 5. One process with a plain
DMuon loads the dict after ``torch.save``/``torch.load`` and trains the same 3
global batches. Tolerance 1e-5: only the order of the gradient sums differs.
"""

from __future__ import annotations

import pytest
import torch
from distributed_cases import OPT, TOLERANCE, full_params, max_diff, setup, train_range

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations import checkpoint
from dmuon.integrations.checkpoint import CheckpointMismatchError
from dmuon.optim import DMuon, param_groups

NAME = "gpt"


def run_full(rank, world, mode):
    model, forward, opt, ded = setup(mode, NAME, world)
    train_range(NAME, forward, opt, rank, world, 0, 2)
    sd = checkpoint.full_state_dict(model, opt)
    train_range(NAME, forward, opt, rank, world, 2, 5)
    ded.wait()
    return sd, full_params(model)


# owner_ddp_z3 (reshard_after_forward): the gathered weights must be copied before the
# weights a rank does not own are freed again (they were read after: a segfault).
@pytest.mark.parametrize("mode", ["owner_ddp_sharded_adamw", "owner_ddp_z3"])
def test_full_state_dict_from_2_ranks_resumes_in_one_process(tmp_path, mode):
    results = run_on_ranks(run_full, 2, args=(mode,), timeout=180)
    sd, expected = results[0]
    assert results[1][0] == {}, "only rank 0 receives the full state dict"
    path = tmp_path / "full.pt"
    torch.save(sd, path)
    model, forward, opt, _ = setup("single", NAME, 1)
    checkpoint.load_full_state_dict(model, opt, torch.load(path, weights_only=True))
    train_range(NAME, forward, opt, 0, 1, 2, 5)
    diff, where = max_diff(full_params(model), expected)
    assert diff <= TOLERANCE, f"{where} off by {diff:.2e}"


# ------------------------------------------------------------------- errors


def _mlp(width=8, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _mlp()
    opt = DMuon(param_groups(model), **OPT)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    path = tmp_path_factory.mktemp("ckpt") / "dcp"
    checkpoint.save(path, model, opt)
    return path, checkpoint.full_state_dict(model, opt)


def _both_fail(saved, model, opt, match):
    path, full = saved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=match):
        checkpoint.load(path, model, opt)
    with pytest.raises(CheckpointMismatchError, match=match):
        checkpoint.load_full_state_dict(model, opt, full)
    for k, v in model.state_dict().items():  # nothing changed
        assert torch.equal(v, before[k]), k


def test_a_shape_mismatch_is_named(saved):
    model = _mlp(width=9)
    _both_fail(saved, model, DMuon(param_groups(model)), r"shape mismatch for 'model\.0\.weight'")


def test_a_missing_key_is_named(saved):
    model = torch.nn.Sequential(*_mlp(), torch.nn.Linear(2, 2))
    _both_fail(saved, model, DMuon(param_groups(model)), r"missing key 'model\.2\.weight'")


def test_a_different_rule_is_named(saved):
    model = _mlp()
    opt = DMuon(param_groups(model), rule="normuon")
    _both_fail(saved, model, opt, r"saved with rule 'muon', the optimizer runs 'normuon'")


def test_groups_that_do_not_check_are_refused_before_the_weights_change(tmp_path):
    # a group key this version does not know (a checkpoint of another release, an edited
    # one) or a value it refuses: refused by DMuon.load_state_dict, but only after the
    # model had loaded the checkpoint's weights (and check() accepted it)
    model = _mlp()
    opt = DMuon(param_groups(model), **OPT)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    opt.param_groups[0]["momentum"] = 1.5
    opt.param_groups[1]["retired_option"] = 1
    checkpoint.save(tmp_path, model, opt)
    full = checkpoint.full_state_dict(model, opt)
    fresh = _mlp(seed=1)
    fresh_opt = DMuon(param_groups(fresh), **OPT)
    match = (
        r"param group 0: momentum must be .*\n"
        r".*param group 1: unknown key\(s\) \['retired_option'\]"
    )
    with pytest.raises(CheckpointMismatchError, match=match):
        checkpoint.check(tmp_path, fresh, fresh_opt)
    _both_fail((tmp_path, full), fresh, fresh_opt, match)


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    model = _mlp()
    with pytest.raises(FileNotFoundError, match="no complete DCP checkpoint"):
        checkpoint.load(tmp_path, model, DMuon(param_groups(model)))


def test_sign_mode_and_other_optimizers_are_refused_clearly(tmp_path):
    model = _mlp()
    sign = DMuon(param_groups(model), rule="sign_muon", mode="sign")
    with pytest.raises(ValueError, match="mode='sign' keeps a different momentum on every rank"):
        checkpoint.save(tmp_path / "sign", model, sign)
    with pytest.raises(TypeError, match=r"optimizer must be a dmuon\.optim\.DMuon, got AdamW"):
        checkpoint.full_state_dict(model, torch.optim.AdamW(model.parameters()))
    other = _mlp()
    with pytest.raises(ValueError, match="is not a parameter of the model given"):
        checkpoint.save(tmp_path / "other", other, DMuon(param_groups(model)))
