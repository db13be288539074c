"""Every ``Example:`` in dmuon.optim's docstrings runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import dmuon.optim

MODULES = sorted(m.name for m in pkgutil.walk_packages(dmuon.optim.__path__, prefix="dmuon.optim."))


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0
