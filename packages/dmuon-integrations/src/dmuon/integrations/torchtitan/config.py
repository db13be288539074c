"""``dmuon_optimizer``: the optimizer config a torchtitan ``Trainer.Config`` takes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dmuon.integrations.torchtitan.container import DMuonOptimizersContainer

__all__ = ["dmuon_optimizer"]


def dmuon_optimizer(
    lr: float = 0.02,
    *,
    mode: str = "sharded",
    split_sizes: Mapping[str, Sequence[int]] | None = None,
    **dmuon: Any,
) -> DMuonOptimizersContainer.Config:
    """A :class:`DMuonOptimizersContainer.Config` with DMuon's own parameter grouping.

    The counterpart of torchtitan's ``default_adamw``: set it as a
    ``Trainer.Config``'s ``optimizer``. Matrices take DMuon's rule (Muon unless
    ``rule=``), embeddings, the output head, norms and biases DMuon's AdamW
    (``adamw_lr`` etc.).

    Args:
        lr: the matrix rule's learning rate (and the AdamW one unless ``adamw_lr``).
        mode: DMuon's execution mode (``sharded`` for FSDP2 / tensor parallel).
        split_sizes: ``{regex: sizes}`` for fused projections whose rows are q, then k,
            then v. Not torchtitan's fused ``wqkv`` (``FusedQKVLinear`` interleaves its
            rows per key/value head, so contiguous blocks mix q, k and v): refused
            there; it is orthogonalised whole, as the recipes do.
        **dmuon: other :class:`~dmuon.optim.DMuon` keyword arguments.

    Examples:
        >>> cfg = dmuon_optimizer(0.02, rule="normuon", adamw_lr=3e-4)
        >>> cfg.mode, cfg.dmuon
        ('sharded', {'lr': 0.02, 'rule': 'normuon', 'adamw_lr': 0.0003})
    """
    return DMuonOptimizersContainer.Config(
        mode=mode,
        dmuon={"lr": lr, **dmuon},
        split_sizes={k: list(v) for k, v in (split_sizes or {}).items()},
    )
