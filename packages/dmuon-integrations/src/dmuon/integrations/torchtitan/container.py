"""DMuon as a torchtitan optimizer: a subclass of torchtitan's ``OptimizersContainer``.

torchtitan resolves ``ParamGroupConfig.optimizer_name`` through a closed table
(``OptimizersContainer._resolve_optimizer_factory``: Adam, AdamW, DistMuon); the
container class itself is the extension point, chosen by its ``Config`` in a
``Trainer.Config`` (``optimizer=DMuonOptimizersContainer.Config(...)``). This one

* builds one :class:`~dmuon.optim.DMuon` over the model part, from DMuon's own
  grouping (:func:`dmuon.optim.param_groups`: matrices to the rule, embeddings, the
  output head, norms and biases to DMuon's AdamW) or from torchtitan
  ``ParamGroupConfig`` patterns whose ``optimizer_name`` is ``"DMuon"``;
* in ``mode="owner"``, dedicates the matrices that
  :func:`~dmuon.integrations.torchtitan.parallelize_for_owners` (the model spec's
  ``parallelize_fn``) left out of FSDP2 to owner ranks
  (:mod:`~dmuon.integrations.torchtitan.owners`);
* otherwise takes the layout from the parameters themselves: after torchtitan's
  ``parallelize_module`` on ``tp`` and FSDP2's ``fully_shard`` on ``dp`` they are
  DTensors, and ``mode="sharded"`` (the default) steps them where they live —
  with expert parallelism, each rank's whole experts where they are, the dense
  matrices by owners over ``dp`` (an expert's rows split over ``efsdp``, torchtitan's
  layout when ``efsdp × ep > num_experts``, is refused:
  :mod:`~dmuon.integrations.torchtitan.experts`);
* drops the ``fused``/``foreach`` keys torchtitan adds to every group
  (:mod:`~dmuon.integrations.torchtitan.options`) and refuses any key DMuon does
  not take, naming it, and ``split_sizes`` on torchtitan's fused ``wqkv``
  (``FusedQKVLinear`` interleaves q, k and v per key/value head);
* refuses a mode other than ``"owner"`` on a model prepared by
  :func:`~dmuon.integrations.torchtitan.parallelize_for_owners` (FSDP2 left its
  matrices out, so nothing else would average their gradients);
* saves and loads through DMuon's sharded state
  (:mod:`~dmuon.integrations.torchtitan.state`), so torchtitan's DCP checkpointer
  reshards it;
* clips with :func:`dmuon.optim.clip_grad_norm_` (:meth:`clip_grad_norm_`, or in
  :meth:`step` when ``Config.max_norm`` is set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from dmuon.integrations.dedication import Dedication
from dmuon.integrations.torchtitan.experts import check_expert_stacks
from dmuon.integrations.torchtitan.options import (
    OPTIMIZER_NAME,
    check_constructor_kwargs,
    check_fused_qkv_splits,
    strip_implementation_keys,
)
from dmuon.integrations.torchtitan.owners import dedicate_for_owners, owner_layout
from dmuon.integrations.torchtitan.state import container_state, load_container_state
from dmuon.optim import DMuon, clip_grad_norm_, param_groups

__all__ = ["DMuonOptimizersContainer"]


class DMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container holding one :class:`~dmuon.optim.DMuon`.

    Build it as torchtitan does, ``config.build(model_parts=[model])``, after the
    model has been parallelised (tensor parallel, FSDP2). ``step``, ``zero_grad``
    and the step hooks are torchtitan's; the state dict is DMuon's sharded one.

    Args:
        config: :class:`DMuonOptimizersContainer.Config`.
        model_parts: the model parts; exactly one (pipeline parallelism, several
            parts per rank, is not supported).

    Raises:
        ValueError: several model parts, a ``ParamGroupConfig`` naming another
            optimizer, a key DMuon does not accept (the error names it),
            ``mode="owner"`` on a model not parallelised for it, another mode on a model
            that is, ``split_sizes`` on torchtitan's fused ``wqkv`` (named),
            ``max_norm`` ≤ 0, or an expert stack whose experts are split over ranks
            (named, with its placements).

    Examples:
        >>> import torch
        >>> from dmuon.integrations.torchtitan import DMuonOptimizersContainer
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> config = DMuonOptimizersContainer.Config(mode="single", dmuon={"lr": 0.02})
        >>> opt = config.build(model_parts=[model])
        >>> type(opt.dmuon).__name__, opt.dmuon.engine.mode
        ('DMuon', 'single')
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        mode: str = "sharded"
        """DMuon's execution mode (``sharded``: FSDP2 / tensor-parallel DTensor
        parameters stepped where they live, expert-parallel stacks as each rank's whole
        experts; ``owner``: each matrix whole on one owner rank, for a model parallelised
        by :func:`~dmuon.integrations.torchtitan.parallelize_for_owners` (the container
        dedicates the matrices FSDP2 left out; :mod:`~dmuon.integrations.torchtitan.owners`);
        ``single``: one process, or expert stacks that live whole on their ranks;
        ``replicated``: DDP-replicated parameters)."""

        dmuon: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments of :class:`~dmuon.optim.DMuon` (``lr``, ``rule``,
        ``weight_decay``, ``adamw_lr``, rule options, …)."""

        split_sizes: dict[str, list[int]] = field(default_factory=dict)
        """With no ``param_groups``: ``{regex: sizes}`` for fused projections whose rows are
        q, then k, then v, passed to :func:`dmuon.optim.param_groups`. Not torchtitan's
        fused ``wqkv`` (``FusedQKVLinear``): it interleaves its rows per key/value head,
        so contiguous blocks would mix q, k and v rows; it is refused there (the recipes
        orthogonalise ``wqkv`` whole)."""

        max_norm: float | None = None
        """Clip the gradients to this global norm with :func:`dmuon.optim.clip_grad_norm_`
        at the start of every :meth:`step` (``None``: no clipping here). torchtitan's
        trainer clips with its own function first (``training.max_norm``), which is
        right for DTensor gradients (``sharded``); for a mode whose gradients are not
        complete DTensors (``owner``: the dedicated matrices' gradients are reduced in
        :meth:`step`), set ``training.max_norm`` to ``inf`` and this instead."""

    dmuon: DMuon
    dedication: Dedication | None
    """``mode="owner"``: the :class:`~dmuon.integrations.Dedication` (its ``wait()`` lands
    the last step's weights on every rank before they are read outside a forward, its
    ``no_sync()`` keeps micro-batches local); ``None`` in the other modes."""
    last_grad_norm: torch.Tensor | None
    """The norm :attr:`Config.max_norm` clipping measured at the last :meth:`step`."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ValueError(
                f"model_parts: DMuonOptimizersContainer takes one model part, got "
                f"{len(model_parts)} (pipeline parallelism with several stages per rank is "
                "not supported)"
            )
        check_constructor_kwargs(config.dmuon, "DMuonOptimizersContainer.Config.dmuon")
        if config.max_norm is not None and not config.max_norm > 0:
            raise ValueError(
                f"DMuonOptimizersContainer.Config.max_norm must be > 0 (or None: no "
                f"clipping), got {config.max_norm!r}"
            )
        model = model_parts[0]
        _check_mode_fits_layout(model, config.mode)
        groups = self._dmuon_groups(config, model)
        check_fused_qkv_splits(model, groups)
        check_expert_stacks(model, groups, str(config.dmuon.get("rule", "muon")))
        kwargs = {"mode": config.mode, **config.dmuon}
        # owner mode: dedicated now, after init_weights (the owners' weights go to every rank)
        ded = dedicate_for_owners(model) if config.mode == "owner" else None
        if ded is not None:
            kwargs["distributed"] = ded
        try:
            optimizer = DMuon(groups, **kwargs)
        except (TypeError, ValueError) as err:
            if ded is not None:
                # let the matrices go (not just the hooks): the corrected config can
                # dedicate them again on the same model
                ded.undedicate()
            raise type(err)(f"torchtitan optimizer config for DMuon: {err}") from err
        self.dmuon = optimizer
        self.dedication = ded
        self.max_norm = config.max_norm
        self.last_grad_norm = None
        self.optimizers = [optimizer]
        self.model_parts = model_parts
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._validate_params(params)
        self._post_init(params)

    def _dmuon_groups(self, config: Config, model: nn.Module) -> list[dict[str, Any]]:
        """DMuon's groups: its own grouping, or the config's patterns (all ``"DMuon"``)."""
        if not config.param_groups:
            return list(param_groups(model, split_sizes=config.split_sizes or None))
        if config.split_sizes:
            raise ValueError(
                "DMuonOptimizersContainer.Config.split_sizes applies to DMuon's own grouping; "
                "with param_groups, put 'split_sizes' in that group's optimizer_kwargs"
            )
        for i, pg in enumerate(config.param_groups):
            if pg.optimizer_name != OPTIMIZER_NAME:
                raise ValueError(
                    f"param_groups[{i}] (pattern {pg.pattern!r}): optimizer_name "
                    f"{pg.optimizer_name!r}; DMuonOptimizersContainer steps every group "
                    f"with DMuon: use {OPTIMIZER_NAME!r} (scalar parameters: "
                    "optimizer_kwargs={'rule': 'scalar'})"
                )
            check_constructor_kwargs(pg.optimizer_kwargs, f"param_groups[{i}].optimizer_kwargs")
        by_name, _ = self._build_param_groups(
            model, config.param_groups, self._build_impl_kwargs(config)
        )
        return strip_implementation_keys(by_name[OPTIMIZER_NAME])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm, DMuon's way; return the norm.

        :func:`dmuon.optim.clip_grad_norm_` over the one DMuon: correct in every mode
        (in ``sharded`` mode it equals torchtitan's own clipping of the DTensor
        gradients, which a trainer may keep using).
        """
        return clip_grad_norm_(self.dmuon, max_norm, norm_type)

    def step(self, closure: Any = None) -> None:
        """Clip (when :attr:`Config.max_norm` is set), then step DMuon."""
        if closure is not None:
            raise ValueError("closure: DMuonOptimizersContainer.step takes no closure")
        if self.max_norm is not None:
            self.last_grad_norm = self.clip_grad_norm_(self.max_norm)
        self.dmuon.step()

    def state_dict(self) -> dict[str, Any]:
        """DMuon's sharded state (``{"state": {fqn: …}, "param_groups": […]}``), the
        same keys on every rank; collective. See :mod:`~dmuon.integrations.torchtitan.state`."""
        return container_state(self.model_parts[0], self.dmuon)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what DCP read into :meth:`state_dict`'s tensors (at any world size)."""
        load_container_state(self.model_parts[0], self.dmuon, state_dict)


def _check_mode_fits_layout(model: nn.Module, mode: str | None) -> None:
    """Refuse a mode other than ``"owner"`` on a model
    :func:`~dmuon.integrations.torchtitan.parallelize_for_owners`
    prepared (on every rank alike: each rank recorded the same layout).

    That ``parallelize_fn`` leaves the matrices out of FSDP2, so only owner mode's
    reduction to the owners sums their gradients over the ranks: ``single`` would step
    each rank's local gradient (the ranks drift apart), ``replicated`` each matrix with
    its owner's local gradient alone, silently wrong either way.

    Raises:
        ValueError: the mode and what to use instead.
    """
    layout = owner_layout(model)
    if layout is not None and mode != "owner":
        raise ValueError(
            f"DMuonOptimizersContainer.Config.mode={mode!r} on a model parallelised by "
            "dmuon.integrations.torchtitan.parallelize_for_owners: it left "
            f"{len(layout.names)} matrices out of FSDP2 for owner mode, and no other mode "
            "sums their gradients over the ranks; use mode='owner' "
            "(dmuon_optimizer(mode='owner')), or torchtitan's own parallelize_fn for "
            "mode='sharded'"
        )
