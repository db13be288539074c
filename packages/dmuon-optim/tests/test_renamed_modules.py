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


# Every public module-level name each old module had before the rename (at ed20a59^),
# not only those in its __all__: `from dmuon.optim.groups import Predicate` kept working.
OLD_PUBLIC_NAMES = {
    "dmuon.optim.buckets": (
        "Sink",
        "Entry",
        "Bucket",
        "state_shapes",
        "build_buckets",
        "default_batch_elements",
        "step_bucket",
    ),
    "dmuon.optim.groups": (
        "DEFAULT_HEAD_NAMES",
        "Predicate",
        "Assignment",
        "ParamGroups",
        "param_groups",
    ),
    "dmuon.optim.engine.consistency": (
        "ModelMismatchError",
        "check_model_consistency",
        "plan_with_replicated",
    ),
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
