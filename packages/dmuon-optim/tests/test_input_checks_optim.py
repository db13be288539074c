"""Arguments of ``param_groups`` and ``QKClip`` refused (or warned about) with a message
naming them, where they used to end in an AttributeError or be silently ignored."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from dmuon.optim import QKClip, param_groups


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Attn(), nn.Linear(16, 4))


def by_name(groups) -> dict[str, dict]:
    return {n: g for g in groups for n in g["param_names"]}


# -- param_groups(split_sizes=, num_heads=) ---------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"split_sizes": [16, 16, 16]},
        {"split_sizes": (16, 16, 16)},
        {"num_heads": 2},
        {"num_heads": "qkv"},
    ],
)
def test_a_value_that_is_not_a_mapping_is_a_type_error_naming_the_argument(kwargs):
    """``split_sizes=[16, 16, 16]`` (the sizes without their pattern) ended in
    ``AttributeError: 'list' object has no attribute 'items'``."""
    (arg,) = kwargs
    with pytest.raises(TypeError, match=rf"{arg} must be a mapping \{{regex: value\}}"):
        param_groups(model(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_sizes": {3: (16, 16, 16)}}, "split_sizes: patterns must be strings"),
        ({"split_sizes": {r"qkv": 16}}, r"split_sizes\['qkv'\] must be a sequence of sizes"),
        ({"split_sizes": {r"qkv": "16,16,16"}}, r"split_sizes\['qkv'\] must be a sequence"),
        ({"num_heads": {r"qkv": 2.0}}, r"num_heads\['qkv'\] must be an int or a sequence"),
        ({"num_heads": {r"qkv": True}}, r"num_heads\['qkv'\] must be an int"),
    ],
)
def test_a_pattern_or_value_of_the_wrong_kind_is_a_type_error(kwargs, match):
    with pytest.raises(TypeError, match=match):
        param_groups(model(), **kwargs)


def test_a_pattern_that_does_not_compile_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"split_sizes: 'qkv\(' is not a regular expression"):
        param_groups(model(), split_sizes={r"qkv(": (16, 16, 16)})


@pytest.mark.parametrize(("arg", "value"), [("split_sizes", (16, 16, 16)), ("num_heads", 2)])
def test_a_pattern_that_matches_no_parameter_warns_naming_it_and_some_names(arg, value):
    """A typo (``attn\\.qkv`` for a module named ``0.qkv``) left the fused projection
    orthogonalised as one matrix, silently."""
    with pytest.warns(UserWarning, match=r"match no parameter name") as record:
        groups = param_groups(model(), **{arg: {r"attn\.qkv\.weight$": value}})
    message = str(record[0].message)
    assert f"param_groups({arg}=...)" in message
    assert r"attn\\.qkv\\.weight$" in message  # the pattern, as its repr
    assert "0.qkv.weight" in message  # what the names look like
    assert record[0].filename == __file__  # points at the caller's line
    assert arg not in by_name(groups)["0.qkv.weight"]  # and it cut nothing, as before


def test_patterns_that_match_behave_as_before_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = param_groups(
            model(),
            split_sizes={r"\.qkv\.weight$": [16, 16, 16]},
            num_heads={r"\.qkv\.weight$": 2, r"0\.out": (2,)},
        )
        assert param_groups(model(), split_sizes=None, num_heads={}) is not None
    g = by_name(groups)
    assert g["0.qkv.weight"]["split_sizes"] == (16, 16, 16)
    assert g["0.qkv.weight"]["num_heads"] == 2
    assert g["0.out.weight"]["num_heads"] == (2,)
    assert "split_sizes" not in g["1.weight"]


def test_only_the_unmatched_patterns_are_named():
    with pytest.warns(UserWarning, match="match no parameter") as record:
        param_groups(model(), split_sizes={r"qkv": (16, 16, 16), r"typo_qvk": (16, 16, 16)})
    (w,) = [r for r in record if "match no parameter" in str(r.message)]
    assert "typo_qvk" in str(w.message) and "'qkv'" not in str(w.message)


# -- QKClip(max_elements=) ---------------------------------------------------------------


def mha() -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2, batch_first=True)


@pytest.mark.parametrize("bad", [0, -3, 1.5, math.nan, "x", None, True, 2.0])
def test_max_elements_must_be_a_positive_int(bad):
    """``"x"``/``None`` failed at the comparison (TypeError without the name), 1.5 and nan
    were accepted."""
    m = mha()
    with pytest.raises(ValueError, match=r"max_elements must be a positive int.*got"):
        QKClip(m, max_elements=bad)
    assert all(not x._forward_hooks and not x._forward_pre_hooks for x in m.modules())


@pytest.mark.parametrize("good", [1, 7, np.int64(64)])
def test_a_positive_int_max_elements_still_clips_the_same(good):
    x = torch.randn(2, 5, 8)
    reports = []
    for max_elements in (good, 1 << 24):
        m = mha()
        with torch.no_grad():
            m.in_proj_weight.mul_(20.0)
        clip = QKClip(m, tau=10.0, max_elements=max_elements)
        m(x, x, x)
        reports.append(clip.step())
    assert reports[0].clipped_heads == reports[1].clipped_heads == 2
    torch.testing.assert_close(reports[0].max_logits, reports[1].max_logits)


def test_qk_clip_of_something_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match=r"QKClip takes the model \(an nn.Module\).*NoneType"):
        QKClip(None)  # type: ignore[arg-type]
