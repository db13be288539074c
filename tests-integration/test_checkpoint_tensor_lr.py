"""A group ``lr`` given as a tensor (kept by the group and read at every step, as in
``torch.optim``) goes through ``checkpoint.save``/``load`` (DCP) and the full state dict,
and a resumed run steps as the uninterrupted one. Before, DCP's load refused its own
checkpoint: "expected BytesStorageMetadata but found TensorStorageMetadata" for
``optim.param_groups.0.lr`` (the load's targets for group values were all non-tensors)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from dmuon.integrations import checkpoint
from dmuon.optim import DMuon, param_groups


def _setup(lr) -> tuple[nn.Module, DMuon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    return model, DMuon(param_groups(model), lr=lr, ns_compute_dtype=torch.float32)


def _train(model: nn.Module, opt: DMuon, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("how", ["dcp", "full"])
@pytest.mark.parametrize("saved_lr", ["tensor", "float"])
def test_a_tensor_lr_checkpoint_resumes_as_the_uninterrupted_run(tmp_path, how, saved_lr):
    lr = torch.tensor(0.02) if saved_lr == "tensor" else 0.02
    model, opt = _setup(lr)
    _train(model, opt, 0)
    again, opt2 = _setup(torch.tensor(0.02))  # the resumed run passes a tensor lr
    if how == "dcp":
        checkpoint.save(str(tmp_path / "ckpt"), model, opt)
        checkpoint.load(str(tmp_path / "ckpt"), again, opt2)
    else:
        buffer = io.BytesIO()
        torch.save(checkpoint.full_state_dict(model, opt), buffer)
        buffer.seek(0)
        checkpoint.load_full_state_dict(again, opt2, torch.load(buffer, weights_only=True))
    assert [float(g["lr"]) for g in opt2.param_groups] == pytest.approx([0.02, 0.02])
    for seed in (1, 2):
        _train(model, opt, seed)
        _train(again, opt2, seed)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)
