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


# Every public module-level name each old module had before the rename (at ed20a59^),
# not only those in its __all__: `from dmuon.optim.groups import Predicate` kept working.
OLD_PUBLIC_NAMES = {
    "dmuon.comm.buckets": ("BucketSlot", "FlatBucket", "make_buckets"),
    "dmuon.comm.groups": (
        "CollectiveInputError",
        "group_size",
        "group_rank",
        "fingerprint",
        "agree",
    ),
    "dmuon.comm.consistency": ("PlanMismatchError", "check_plan_consistency"),
}


@pytest.mark.parametrize(("old", "names"), sorted(OLD_PUBLIC_NAMES.items()))
def test_every_public_name_of_the_old_module_is_still_there(old, names):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} was renamed"):
        shim = importlib.import_module(old)
    module = importlib.import_module(RENAMED[old])
    for name in names:
        assert getattr(shim, name) is getattr(module, name), name
    with pytest.raises(AttributeError, match=f"module '{old}' has no attribute 'nothing'"):
        shim.nothing  # noqa: B018
