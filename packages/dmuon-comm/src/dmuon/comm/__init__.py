"""dmuon.comm — who owns which matrix, and how gradients and updates travel.

Owner planning by Newton–Schulz cost (LPT, ILP), flat buckets, owner-rooted
reduce and broadcast, the shard all-to-all, all-gather of updates, sign packing
and majority vote, byte accounting and an α–β cost model. Depends on torch only;
it never imports ``dmuon.kernels``. :mod:`dmuon.comm.testing` runs functions on
real multi-process groups for tests.
"""

from dmuon.comm._version import __version__
from dmuon.comm.all_gather_updates import all_gather_updates
from dmuon.comm.cost import NSCost
from dmuon.comm.cost_model import COLLECTIVES, CollectiveCost, cost_model
from dmuon.comm.faults import (
    CollectiveError,
    collective_timeout,
    current_timeout,
    wait_work,
)
from dmuon.comm.flat_buffers import BucketSlot, FlatBucket, make_buckets
from dmuon.comm.flops import ns_flops
from dmuon.comm.handles import CommHandle
from dmuon.comm.items import MatrixItem, layer_key, matrix_items
from dmuon.comm.majority_vote import VOTE_METHODS, majority_vote
from dmuon.comm.objects import all_gather_objects
from dmuon.comm.owner_collectives import broadcast_from_owners, check_buckets, reduce_to_owners
from dmuon.comm.owner_plan import OwnerPlan, OwnerUnit
from dmuon.comm.plan_agreement import PlanMismatchError, check_plan_consistency
from dmuon.comm.planning import DEFAULT_PACK_BELOW, STRATEGIES, plan_owners
from dmuon.comm.process_groups import CollectiveInputError
from dmuon.comm.roll_call import RollCall, call_roll, start_responder
from dmuon.comm.shard_all_to_all import shard_all_to_all, shard_all_to_all_reverse, shard_range
from dmuon.comm.signs import VOTES_PER_BYTE, pack_signs, pack_votes, unpack_signs, unpack_votes
from dmuon.comm.stats import CommStats, OpStats, default_stats
from dmuon.comm.tensor_parallel_cost import TensorParallelPath, gram_restarts, tensor_parallel_path

__all__ = [
    "COLLECTIVES",
    "DEFAULT_PACK_BELOW",
    "STRATEGIES",
    "VOTES_PER_BYTE",
    "VOTE_METHODS",
    "BucketSlot",
    "CollectiveCost",
    "CollectiveError",
    "CollectiveInputError",
    "CommHandle",
    "CommStats",
    "FlatBucket",
    "MatrixItem",
    "NSCost",
    "OpStats",
    "OwnerPlan",
    "OwnerUnit",
    "PlanMismatchError",
    "RollCall",
    "TensorParallelPath",
    "__version__",
    "all_gather_objects",
    "all_gather_updates",
    "broadcast_from_owners",
    "call_roll",
    "check_buckets",
    "check_plan_consistency",
    "collective_timeout",
    "cost_model",
    "current_timeout",
    "default_stats",
    "gram_restarts",
    "layer_key",
    "majority_vote",
    "make_buckets",
    "matrix_items",
    "ns_flops",
    "pack_signs",
    "pack_votes",
    "plan_owners",
    "reduce_to_owners",
    "shard_all_to_all",
    "shard_all_to_all_reverse",
    "shard_range",
    "start_responder",
    "tensor_parallel_path",
    "unpack_signs",
    "unpack_votes",
    "wait_work",
]
