"""dmuon.integrations — how gradients reach DMuon's owners in real training stacks.

* :func:`dmuon.integrations.fsdp.dedicate` — FSDP2 and HSDP: the matrices go to
  owner ranks, ``fully_shard(..., ignored_params=ded.params)`` takes the rest.
* :func:`dmuon.integrations.ddp.dedicate` — a DDP replacement: matrices to owners,
  scalar parameters all-reduced (or owned).
* :mod:`dmuon.integrations.checkpoint` — DCP checkpoints and full state dicts that
  load at any world size (owners' momentum resharded to the new plan).
* :func:`dmuon.integrations.deepspeed.initialize` — DeepSpeed: DMuon as the client
  optimizer for the ZeRO stages it serves whole (stage 0 replicated, 1/2 owner mode).
* :class:`Dedication` — what both return: the owners, the plan, the hooks,
  ``no_sync()`` for gradient accumulation.

* :mod:`dmuon.integrations.hf` — the Hugging Face Trainer (``DMuonTrainer``); import
  it explicitly, it needs ``transformers`` (``pip install "dmuon-optim[hf]"``).
* :mod:`dmuon.integrations.lightning` — Lightning: ``DMuonStrategy`` (owner mode instead of
  the DDP wrapper, whole checkpoints); import it explicitly, it needs ``lightning``.
* :mod:`dmuon.integrations.torchtitan` — torchtitan: ``DMuonOptimizersContainer`` (its
  optimizer container with DMuon inside); import it explicitly, it needs ``torchtitan``.

Stock DDP and stock FSDP2 need nothing from here: ``DMuon(..., mode="replicated")``
and DTensor parameters (``sharded`` mode) are handled by :mod:`dmuon.optim`.
"""

from dmuon.integrations import ddp, deepspeed, fsdp
from dmuon.integrations._version import __version__
from dmuon.integrations.dedication import Dedication
from dmuon.integrations.hooks import install_hooks, module_of_layer
from dmuon.integrations.partial_use import PartialUseError
from dmuon.integrations.selection import mesh_groups, split_parameters

__all__ = [
    "Dedication",
    "PartialUseError",
    "__version__",
    "ddp",
    "deepspeed",
    "fsdp",
    "install_hooks",
    "mesh_groups",
    "module_of_layer",
    "split_parameters",
]
