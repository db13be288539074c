import importlib.metadata

import dmuon.comm


def test_version_matches_distribution_metadata():
    assert dmuon.comm.__version__ == importlib.metadata.version("dmuon-comm")
