import importlib.metadata

import dmuon.integrations


def test_version_matches_distribution_metadata():
    assert dmuon.integrations.__version__ == importlib.metadata.version("dmuon-integrations")
