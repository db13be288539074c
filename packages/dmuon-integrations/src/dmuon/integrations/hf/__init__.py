"""dmuon.integrations.hf — DMuon in the Hugging Face ``transformers.Trainer``.

Importing this module imports ``transformers`` (``pip install "dmuon-optim[hf]"``);
``dmuon.integrations`` itself does not.

* :class:`DMuonTrainer` — a ``Trainer`` that builds DMuon and saves/loads its full
  state with Trainer checkpoints, on one process or under torchrun (DDP).
* :func:`optimizer_cls_and_kwargs` / :class:`DMuonFactory` — DMuon for a stock
  ``Trainer(optimizer_cls_and_kwargs=...)``.
* :func:`build_dmuon`, :func:`dmuon_kwargs` — ``TrainingArguments`` → DMuon.
* :func:`gather_full_state_dict`, :func:`missing_state`, :func:`unwrap_optimizer` —
  one-file optimizer state from every owner's share.
"""

from dmuon.integrations.hf.factory import (
    DMuonFactory,
    build_dmuon,
    dmuon_kwargs,
    optimizer_cls_and_kwargs,
)
from dmuon.integrations.hf.state import gather_full_state_dict, missing_state, unwrap_optimizer
from dmuon.integrations.hf.trainer import DMuonTrainer

__all__ = [
    "DMuonFactory",
    "DMuonTrainer",
    "build_dmuon",
    "dmuon_kwargs",
    "gather_full_state_dict",
    "missing_state",
    "optimizer_cls_and_kwargs",
    "unwrap_optimizer",
]
