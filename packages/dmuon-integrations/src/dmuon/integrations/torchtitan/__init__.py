"""torchtitan: DMuon as a torchtitan optimizer container (extra ``[torchtitan]``).

* :class:`DMuonOptimizersContainer` — a subclass of torchtitan's
  ``OptimizersContainer`` with its own ``Config``: DMuon built from the model part
  torchtitan parallelised, its state saved and resharded by torchtitan's DCP
  checkpointer, clipping by :func:`dmuon.optim.clip_grad_norm_`.
* :func:`dmuon_optimizer` — a ``DMuonOptimizersContainer.Config`` for a
  ``Trainer.Config``.
* :func:`parallelize_for_owners` — the model spec's ``parallelize_fn`` for
  ``mode="owner"``: FSDP2 leaves the matrices out, the container dedicates them
  (:mod:`dmuon.integrations.torchtitan.owners`).
* :mod:`dmuon.integrations.torchtitan.recipes` — debug-size Llama 3 and DeepSeek-V3
  (MoE) trainer configs with DMuon, for ``--module dmuon.integrations.torchtitan.recipes``
  (import it explicitly: it needs torchtitan's trainer dependencies).
"""

from dmuon.integrations.extras import raise_missing_extra

try:
    from dmuon.integrations.torchtitan.config import dmuon_optimizer
    from dmuon.integrations.torchtitan.container import DMuonOptimizersContainer
    from dmuon.integrations.torchtitan.options import IMPLEMENTATION_KEYS, OPTIMIZER_NAME
    from dmuon.integrations.torchtitan.owners import (
        OwnerLayout,
        dedicate_for_owners,
        owner_layout,
        parallelize_for_owners,
    )
except ModuleNotFoundError as err:  # named: the extra to install
    raise_missing_extra(err, __name__, "torchtitan")
    raise

__all__ = [
    "IMPLEMENTATION_KEYS",
    "OPTIMIZER_NAME",
    "DMuonOptimizersContainer",
    "OwnerLayout",
    "dedicate_for_owners",
    "dmuon_optimizer",
    "owner_layout",
    "parallelize_for_owners",
]
