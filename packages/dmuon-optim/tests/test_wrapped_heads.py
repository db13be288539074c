"""``param_groups`` finds a root ``fc`` head through the wrappers of a whole model.

torchvision's classifiers read out through ``model.fc``; :data:`ROOT_HEAD_NAMES` sends it
to AdamW when the model holds it itself. Wrapped whole — ``torch.compile(model)`` (held as
``_orig_mod``) or DDP (held as ``module``) — its name became ``_orig_mod.fc`` /
``module.fc`` and it went to the matrix rule instead, silently.
"""

import torch
from torch import nn

from dmuon.optim import param_groups


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(8, 16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.layer1(x)))


class Holder(nn.Module):
    """A wrapper that holds the model as ``module``, as DDP does (DDP itself needs a
    process group; the names are what matter here)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def matrix_names(model: nn.Module) -> set[str]:
    groups = param_groups(model)
    return {n for g in groups if g.get("rule") != "scalar" for n in g["param_names"]}


def test_the_bare_models_root_fc_is_the_head():
    assert matrix_names(Classifier()) == {"layer1.weight"}


def test_a_compiled_models_root_fc_is_still_the_head():
    compiled = torch.compile(Classifier(), backend="eager")  # not run: names only
    assert matrix_names(compiled) == {"_orig_mod.layer1.weight"}


def test_a_ddp_like_wrappers_root_fc_is_still_the_head():
    assert matrix_names(Holder(Classifier())) == {"module.layer1.weight"}
    wrapped_twice = torch.compile(Holder(Classifier()), backend="eager")
    assert matrix_names(wrapped_twice) == {"_orig_mod.module.layer1.weight"}


def test_an_fc_below_a_wrapper_inside_the_model_stays_a_hidden_matrix():
    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Holder(Classifier())  # 'block.module.fc': not held by the model
            self.head = nn.Linear(3, 2)

    names = matrix_names(Deep())
    assert "block.module.fc.weight" in names and "head.weight" not in names
