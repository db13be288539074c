"""Modules renamed so that each name means one thing keep their old name for one
release: importing it warns and gives the same objects."""

import importlib
import sys

import pytest

RENAMED = {
    "dmuon.comm.buckets": "dmuon.comm.flat_buffers",
    "dmuon.comm.groups": "dmuon.comm.process_groups",
    "dmuon.comm.consistency": "dmuon.comm.plan_agreement",
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
