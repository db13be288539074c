import importlib.metadata

import dmuon.optim


def test_version_matches_distribution_metadata():
    assert dmuon.optim.__version__ == importlib.metadata.version("dmuon-optim")
