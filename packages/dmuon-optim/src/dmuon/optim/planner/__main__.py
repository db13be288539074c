"""``python -m dmuon.optim.planner``: the same as ``dmuon-plan``."""

import sys

from dmuon.optim.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
