"""Checkpoints of DMuon training that survive a change of world size.

* :func:`save` / :func:`load` — ``torch.distributed.checkpoint`` (DCP): every rank
  writes its part, owner-held momentum once; load at any world size (resharding);
  :func:`check` runs :func:`load`'s checks alone.
* :func:`full_state_dict` / :func:`load_full_state_dict` — one ``torch.save``-able
  dict gathered to rank 0, loadable at any world size, one process included.
* :func:`optimizer_state_dict` — DMuon's state in the FQN-keyed, rank-symmetric
  form of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``.
"""

from dmuon.integrations.checkpoint.compat import CheckpointMismatchError, CheckpointReadError
from dmuon.integrations.checkpoint.dcp import check, load, save
from dmuon.integrations.checkpoint.full import full_state_dict, load_full_state_dict
from dmuon.integrations.checkpoint.holders import Holding, holdings
from dmuon.integrations.checkpoint.sharded_state import optimizer_state_dict

__all__ = [
    "CheckpointMismatchError",
    "CheckpointReadError",
    "Holding",
    "check",
    "full_state_dict",
    "holdings",
    "load",
    "load_full_state_dict",
    "optimizer_state_dict",
    "save",
]
