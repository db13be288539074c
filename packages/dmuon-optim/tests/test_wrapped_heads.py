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


# PEFT's module names, mocked (peft is not a dependency): a PeftModel holds the model as
# base_model.model; modules_to_save keeps a trainable copy of a head as
# <head>.modules_to_save.<adapter> beside the frozen <head>.original_module; LoRA keeps
# <layer>.lora_A.<adapter> and lora_B.<adapter> beside the frozen <layer>.base_layer.


class ModulesToSave(nn.Module):
    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.original_module = head.requires_grad_(False)
        self.modules_to_save = nn.ModuleDict({"default": nn.Linear(16, 3)})


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})


class Tuner(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class PeftLike(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = Tuner(model)


class SequenceClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.q_proj = nn.Linear(16, 16)
        self.classifier = nn.Linear(16, 3)


def test_a_peft_heads_trainable_copy_and_lora_factors_follow_the_head():
    model = SequenceClassifier()
    model.q_proj = LoraLinear(model.q_proj)
    model.classifier = ModulesToSave(model.classifier)
    model.embed_tokens.requires_grad_(False)
    names = matrix_names(PeftLike(model))
    # Before: the classifier's copy went to the matrix rule (its module's own name is the
    # adapter's, 'default').
    assert names == {
        "base_model.model.q_proj.lora_A.default.weight",
        "base_model.model.q_proj.lora_B.default.weight",
    }


def test_lora_on_an_lm_head_sends_both_factors_to_adamw():
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = LoraLinear(nn.Linear(16, 16))
            self.lm_head = LoraLinear(nn.Linear(16, 50, bias=False))

    names = matrix_names(PeftLike(LM()))
    # Before: lm_head.lora_A went to the matrix rule and lora_B to AdamW.
    assert names == {
        "base_model.model.up.lora_A.default.weight",
        "base_model.model.up.lora_B.default.weight",
    }


def test_a_peft_root_fc_heads_copy_is_the_head():
    model = Classifier()
    model.fc = ModulesToSave(model.fc)
    assert matrix_names(PeftLike(model)) == {"base_model.model.layer1.weight"}


def test_peft_trainable_tokens_are_embedding_rows_for_adamw():
    # LoraConfig(trainable_token_indices={"embed_tokens": [...]}) trains a few embedding
    # rows as embed_tokens.token_adapter.trainable_tokens_delta.<adapter> (k × d). Before:
    # a 2-D hidden weight for the matrix rule (and dedicated).
    class TokenAdapter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trainable_tokens_delta = nn.ParameterDict(
                {"default": nn.Parameter(torch.zeros(3, 16))}
            )

    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_layer = nn.Embedding(50, 16).requires_grad_(False)
            self.token_adapter = TokenAdapter()

    model = SequenceClassifier()
    model.embed_tokens = Embedding()
    model.q_proj = LoraLinear(model.q_proj)
    model.classifier = ModulesToSave(model.classifier)
    groups = param_groups(PeftLike(model))
    by_name = {n: g.get("rule") for g in groups for n in g["param_names"]}
    delta = "base_model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"
    assert by_name[delta] == "scalar"
    assert matrix_names(PeftLike(model)) == {
        "base_model.model.q_proj.lora_A.default.weight",
        "base_model.model.q_proj.lora_B.default.weight",
    }
