"""dmuon.integrations.hf — DMuon in the Hugging Face ``transformers.Trainer``.

:class:`DMuonTrainer` needs ``transformers`` (``pip install "dmuon-optim[hf]"``) and
imports it when first used; the other names need only torch, so the state helpers
work without it (and ``dmuon.integrations`` never imports this module).

* :class:`DMuonTrainer` — a ``Trainer`` that builds DMuon and saves/loads its full
  state with Trainer checkpoints, on one process or under torchrun (DDP).
* :func:`optimizer_cls_and_kwargs` / :class:`DMuonFactory` — DMuon for a stock
  ``Trainer(optimizer_cls_and_kwargs=...)``.
* :func:`build_dmuon`, :func:`dmuon_kwargs` — ``TrainingArguments`` → DMuon.
* :func:`gather_full_state_dict`, :func:`missing_state`, :func:`unwrap_optimizer` —
  one-file optimizer state from every owner's share.
"""

from typing import TYPE_CHECKING, Any

from dmuon.integrations.hf.factory import (
    DMuonFactory,
    build_dmuon,
    dmuon_kwargs,
    optimizer_cls_and_kwargs,
)
from dmuon.integrations.hf.state import gather_full_state_dict, missing_state, unwrap_optimizer

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    # A lazy re-export (PEP 562): ``DMuonTrainer`` subclasses transformers.Trainer, and
    # importing transformers takes seconds; only code that uses the Trainer pays for it.
    if name == "DMuonTrainer":
        from dmuon.integrations.hf.trainer import DMuonTrainer

        return DMuonTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
