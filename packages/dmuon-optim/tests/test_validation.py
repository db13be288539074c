"""Bad input is refused in the constructor with a ValueError that names the parameter,
key or value and says what would be right."""

import pytest
import torch
from torch import nn

from dmuon.optim import RULES, DMuon


def mat(*shape):
    return nn.Parameter(torch.randn(*shape))


def test_1d_parameter_in_a_matrix_group_names_it_and_the_fix():
    with pytest.raises(ValueError, match=r"'fc\.bias'.*shape \(4,\).*at least 2 dimensions.*adamw"):
        DMuon([("fc.weight", mat(4, 3)), ("fc.bias", mat(4))])
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 \(shape \(4,\)\)"):
        DMuon([mat(4, 3), mat(4)])


def test_scalar_parameter_in_a_matrix_group():
    with pytest.raises(ValueError, match=r"0-D.*at least 2 dimensions"):
        DMuon([mat(3, 3), nn.Parameter(torch.tensor(1.0))])


def test_non_float_parameter_names_dtype_and_allowed_ones():
    with pytest.raises(ValueError, match=r"dtype torch.int64.*torch.float32"):
        DMuon([mat(3, 3), torch.zeros(3, 3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"dtype torch.complex64"):
        DMuon([{"params": [torch.zeros(3, dtype=torch.complex64)], "rule": "adamw"}])


@pytest.mark.parametrize("lr", [-1.0, -1e-9, float("nan"), float("inf")])
def test_bad_lr(lr):
    with pytest.raises(ValueError, match=r"lr must be a finite real number >= 0.0"):
        DMuon([mat(3, 3)], lr=lr)


def test_bad_lr_in_a_group_names_the_group():
    with pytest.raises(ValueError, match=r"param group 1: lr must be"):
        DMuon([{"params": [mat(3, 3)]}, {"params": [mat(2, 2)], "lr": -0.1}])


@pytest.mark.parametrize("momentum", [1.0, -0.1, 1.5])
def test_momentum_outside_unit_interval(momentum):
    with pytest.raises(ValueError, match=r"momentum must be a real number in \[0.0, 1.0\)"):
        DMuon([mat(3, 3)], momentum=momentum)


def test_unknown_rule_lists_the_rules():
    with pytest.raises(ValueError, match=r"unknown rule 'muonx'.*'normuon'"):
        DMuon([mat(3, 3)], rule="muonx")
    with pytest.raises(ValueError, match=r"unknown rule 'sgd'.*'adamw', 'lion', 'scalar'"):
        DMuon([{"params": [mat(3, 3)], "rule": "sgd"}])


def test_unknown_group_key_is_named_with_the_accepted_ones():
    # a silently ignored `betas` on a Muon group is the trap this guards against
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['betas'\] for rule 'muon'.*'momentum'"
    ):
        DMuon([{"params": [mat(3, 3)], "betas": (0.9, 0.95)}])
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['momentum'\] for rule 'adamw'.*'betas'"
    ):
        DMuon([{"params": [mat(3)], "rule": "adamw", "momentum": 0.9}])
    with pytest.raises(ValueError, match=r"\['eps'\] for rule 'lion'"):
        DMuon([{"params": [mat(3)], "rule": "lion", "eps": 1e-8}])


def test_rule_option_of_another_rule_is_refused():
    with pytest.raises(
        ValueError, match=r"unknown option\(s\) \['beta2'\] for rule\(s\) \['muon'\]"
    ):
        DMuon([mat(3, 3)], rule="muon", beta2=0.9)
    # but accepted when some group runs a rule that takes it
    opt = DMuon([{"params": [mat(3, 3)]}, {"params": [mat(2, 2)], "rule": "normuon"}], beta2=0.9)
    assert opt.param_groups[1]["beta2"] == 0.9 and "beta2" not in opt.param_groups[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight_decay": -0.1}, "weight_decay must be"),
        (
            {"adjust_lr": "rms"},
            r"adjust_lr must be one of \['original', 'match_rms_adamw', 'spectral', None\]",
        ),
        ({"ns_method": "svd"}, r"ns_method must be one of \['gram', 'standard'\]"),
        ({"ns_coefficients": "kellerr"}, r"ns_coefficients must be one of \['keller'"),
        ({"ns_coefficients": [(1.0, 2.0)]}, "ns_coefficients must be"),
        ({"ns_steps": 0}, "ns_steps must be an integer >= 1"),
        ({"ns_steps": 2.5}, "ns_steps must be an integer"),
        ({"nesterov": 1}, "nesterov must be True or False"),
        ({"ns_compute_dtype": "int8"}, "ns_compute_dtype must be None or one of"),
        ({"scalar_optimizer": "sgd"}, r"scalar_optimizer must be one of \['adamw', 'lion'\]"),
        ({"adamw_betas": (0.9, 1.0)}, r"adamw_betas must be a pair"),
        ({"adamw_lr": -1.0}, "adamw_lr must be"),
        ({"adamw_eps": -1.0}, "adamw_eps must be"),
        ({"rule": "dion2", "fraction": 0.0}, r"fraction must be a real number in \(0.0, 1.0\]"),
        ({"rule": "musec", "clip_mode": "medium"}, r"clip_mode must be one of \['hard', 'soft'\]"),
        ({"rule": "muonbp", "period": 0}, "period must be an integer >= 1"),
        ({"rule": "numuon", "rank_schedule": "step"}, "rank_schedule must be one of"),
    ],
)
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DMuon([mat(3, 3)], **kwargs)


def test_higher_dim_parameter_needs_an_explicit_flatten():
    with pytest.raises(ValueError, match=r"shape \(4, 3, 3, 3\).*'flatten': True for a conv"):
        DMuon([mat(4, 3, 3, 3)])
    DMuon([{"params": [mat(4, 3, 3, 3)], "flatten": True}])
    DMuon([{"params": [mat(4, 3, 5)], "flatten": False}])


def test_bad_split_sizes_and_heads():
    with pytest.raises(
        ValueError, match=r"split_sizes \(4, 4\) sum to 8 but the matrix has 12 rows"
    ):
        DMuon([{"params": [mat(12, 4)], "split_sizes": (4, 4)}])
    with pytest.raises(ValueError, match=r"12 rows cannot be cut into 5 heads"):
        DMuon([{"params": [mat(12, 4)], "num_heads": 5}])
    with pytest.raises(ValueError, match=r"num_heads must be"):
        DMuon([{"params": [mat(12, 4)], "num_heads": 0}])


def test_non_contiguous_matrix_parameter():
    w = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not contiguous"):
        DMuon([{"params": [nn.Parameter(w)], "flatten": True}])


def test_parameter_in_two_groups():
    p = mat(3, 3)
    with pytest.raises(ValueError, match="more than one parameter group"):
        DMuon([{"params": [p]}, {"params": [p]}])


def test_changing_a_group_structure_after_construction_is_refused_at_step():
    p = mat(4, 4)
    opt = DMuon([p])
    opt.param_groups[0]["rule"] = "normuon"
    p.grad = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="changed its structure"):
        opt.step()


def test_sparse_gradients_are_refused():
    p = mat(4, 4)
    opt = DMuon([p])
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_every_rule_builds_with_defaults():
    for rule in RULES:
        DMuon([mat(6, 8)], rule=rule)


def _language_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.embed_tokens = nn.Embedding(16, 8)
    model.up = nn.Linear(8, 32, bias=False)
    model.lm_head = nn.Linear(8, 16, bias=False)
    return model


def test_embedding_and_head_in_a_matrix_group_warn_naming_them_and_the_fix():
    """``DMuon(model.named_parameters())`` of a model without biases and norms raises no
    1-D error, and would orthogonalise the embedding and the head: it warns, naming them."""
    model = _language_model()
    with pytest.warns(UserWarning, match="named like an embedding or an output head") as caught:
        DMuon(model.named_parameters())
    text = " ".join(str(w.message) for w in caught)
    assert "'embed_tokens.weight', 'lm_head.weight'" in text
    assert "'up.weight'" not in text
    assert "dmuon.optim.param_groups(model)" in text and "rule='adamw'" in text


def test_param_groups_and_deliberate_choices_do_not_warn():
    import warnings

    from dmuon.optim import param_groups

    model = _language_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DMuon(param_groups(model))
        DMuon(param_groups(model, matrix=lambda name, p: p.ndim == 2))  # chosen on purpose
        DMuon([("up.weight", model.up.weight)])  # a hidden matrix alone
        DMuon([{"params": [model.embed_tokens.weight], "rule": "adamw"}])
