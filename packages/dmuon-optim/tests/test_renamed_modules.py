"""Modules renamed so that each name means one thing keep their old name for one
release: importing it warns and gives the same objects."""

import importlib
import sys

import pytest

RENAMED = {
    "dmuon.optim.buckets": "dmuon.optim.batches",
    "dmuon.optim.groups": "dmuon.optim.assignment",
    "dmuon.optim.engine.consistency": "dmuon.optim.engine.model_agreement",
}


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_the_old_name_warns_and_gives_the_same_objects(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} was renamed {new}"):
        shim = importlib.import_module(old)
    module = importlib.import_module(new)
    assert shim.__all__ == module.__all__
    for name in module.__all__:
        assert getattr(shim, name) is getattr(module, name), name
