"""DMuon's owner mode under PyTorch Lightning: a strategy that dedicates instead of wrapping.

Lightning's DDP strategy wraps the model in ``DistributedDataParallel``, which
all-reduces every gradient; DMuon can then only run in ``replicated`` mode.
:class:`DMuonStrategy` is a ``DDPStrategy`` (same launcher, process group, samplers,
``reduce``/``barrier``) that *dedicates* the model instead
(:func:`dmuon.integrations.ddp.dedicate`): each matrix's gradient is reduced to its
owner rank only, the owner orthogonalises it and broadcasts the new weight::

    trainer = L.Trainer(strategy=DMuonStrategy(), devices=2, ...)

    class Model(L.LightningModule):
        def configure_optimizers(self):
            return dmuon_optimizer(self, lr=0.02)   # owner, replicated or single mode

Lightning's gradient clipping (``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``)
of a DMuon goes through :func:`dmuon.optim.clip_grad_norm_` and
:func:`dmuon.optim.clip_grad_value_`, which clip the averaged gradients where they live
(in owner mode each matrix's on its owner, once the reductions have finished); torch's
functions, which Lightning calls otherwise, would change the local gradients after they
had left for their owners (owner mode refuses that step, ``GradientChangedError``).
fp16 loss scaling (``precision="16-mixed"``) works in owner mode too: the strategy gives
the precision plugin a ``ShardedGradScaler`` (every rank's Inf flags summed), and the
gradients are unscaled once their reductions have finished.

It also makes Lightning checkpoints whole: Lightning writes the optimizer state of
rank 0 only, but in owner and replicated mode each matrix's momentum lives on its
owner rank. The strategy gathers every owner's share when a checkpoint is saved (a
collective; Lightning dumps checkpoints on every rank) and gives each rank its share
back when ``trainer.fit(..., ckpt_path=...)`` resumes, at any world size.

Lightning is imported by this module: ``dmuon.integrations`` never imports it, import
``dmuon.integrations.lightning`` explicitly (``pip install "dmuon-integrations[lightning]"``).
Importing it registers ``strategy="dmuon"`` (owner mode, defaults) with Lightning.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from dmuon.comm import CollectiveError
from dmuon.integrations import ddp
from dmuon.integrations.checkpoint import full_state_dict, load_full_state_dict
from dmuon.integrations.dedication import Dedication
from dmuon.integrations.extras import raise_missing_extra
from dmuon.integrations.hf.state import gather_full_state_dict, missing_state
from dmuon.integrations.hooks import wait_modules
from dmuon.integrations.partial_use import PartialUseCheck, PartialUseError
from dmuon.optim import DMuon, clip_grad_norm_, clip_grad_value_, param_groups
from dmuon.optim.engine import exchange_of
from dmuon.optim.loss_scaling import AGREED_MODES
from dmuon.optim.optimizer_state import FULL_STATE_FORMAT

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ModuleNotFoundError as err:  # named: the extra to install
    raise_missing_extra(err, __name__, "lightning")
    raise

__all__ = [
    "CHECKPOINT_FORMAT",
    "STRATEGY_MODES",
    "DMuonPrecision",
    "DMuonStrategy",
    "agree_loss_scaler",
    "dmuon_optimizer",
    "with_dmuon_precision",
]

STRATEGY_MODES = ("owner", "replicated")
"""The modes of :class:`DMuonStrategy`: ``"owner"`` dedicates the model (no DDP wrapper),
``"replicated"`` keeps Lightning's DDP wrapper and only makes checkpoints whole."""

CHECKPOINT_FORMAT = FULL_STATE_FORMAT
"""The ``"format"`` of an owner-mode entry of a checkpoint's ``"optimizer_states"``:
``{"format": CHECKPOINT_FORMAT, "optim": ..., "dmuon": ...}``, the optimizer part of
:func:`dmuon.integrations.checkpoint.full_state_dict` (the weights are the checkpoint's
``"state_dict"``)."""

# DDPStrategy arguments that configure the DDP wrapper or its communication hooks:
# in owner mode there is no wrapper, and silently dropping them would surprise.
_DDP_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class DMuonStrategy(DDPStrategy):
    """Lightning's DDP strategy with DMuon's owner hooks in place of the DDP wrapper.

    In ``mode="owner"`` (the default) :meth:`configure_ddp` calls
    :func:`dmuon.integrations.ddp.dedicate` on the LightningModule instead of wrapping
    it; :attr:`dedication` is then what ``DMuon(..., distributed=...)`` takes
    (:func:`dmuon_optimizer` does it). Gradient accumulation
    (``Trainer(accumulate_grad_batches=k)``) skips the reductions of the first ``k-1``
    micro-batches through ``dedication.no_sync()``.

    In ``mode="replicated"`` the model is wrapped in DDP as by ``strategy="ddp"``;
    DMuon runs in replicated mode and the strategy only makes checkpoints whole.

    Gradient clipping (``Trainer(gradient_clip_val=...)``, by norm or by value) of a
    DMuon is :func:`dmuon.optim.clip_grad_norm_` / :func:`dmuon.optim.clip_grad_value_`
    in either mode and any precision: the precision plugin Lightning picks (from
    ``precision=`` or ``plugins=``) is kept, and its clipping methods hand a DMuon to
    DMuon's functions (other optimizers are clipped by the plugin as before; see
    :class:`DMuonPrecision`). With ``precision="16-mixed"`` in owner mode the plugin's
    ``GradScaler`` becomes a ``ShardedGradScaler`` with the same settings
    (:func:`agree_loss_scaler`), so that every rank skips a step with an Inf
    gradient and scales its loss alike, and the step unscales through
    :meth:`dmuon.optim.DMuon.unscale_`, after the reductions to the owners.

    Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``) hold every owner's
    optimizer state, gathered to rank 0 when saving; ``trainer.fit(..., ckpt_path=)``
    gives each rank its share back, at any world size (one process included:
    ``DMuonStrategy()`` with ``devices=1``; other strategies cannot read it). Other
    optimizers in ``configure_optimizers`` are saved and loaded as Lightning does.

    Args:
        mode: ``"owner"`` or ``"replicated"`` (see :data:`STRATEGY_MODES`).
        scalars: owner mode: ``"all_reduce"`` (biases, norms, embeddings all-reduced,
            stepped on every rank, like DDP) or ``"owner"`` (dedicated too: sharded
            AdamW state). See :func:`dmuon.integrations.ddp.dedicate`.
        dedicate_options: more keyword arguments of
            :func:`dmuon.integrations.ddp.dedicate` (``reshard_after_forward``,
            ``strategy``, ``stats``, ``predicate``, ...), owner mode only.
        **kwargs: the arguments of Lightning's ``DDPStrategy`` (``accelerator``,
            ``process_group_backend``, ``timeout``, ``start_method``, ...); in
            replicated mode also those of ``DistributedDataParallel``.

    Raises:
        ValueError: an unknown ``mode``, options of the other mode, or arguments of
            the DDP wrapper (``find_unused_parameters``, ``ddp_comm_hook``, ...) in
            owner mode, where there is no wrapper.

    Examples:
        >>> from dmuon.integrations.lightning import DMuonStrategy
        >>> strategy = DMuonStrategy(scalars="owner")
        >>> strategy.mode, strategy.dedication is None  # dedicated in Trainer.fit
        ('owner', True)
        >>> DMuonStrategy(find_unused_parameters=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: DMuonStrategy(mode='owner') builds no DDP wrapper, ...
    """

    def __init__(
        self,
        mode: str = "owner",
        *,
        scalars: str = "all_reduce",
        dedicate_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in STRATEGY_MODES:
            raise ValueError(f"mode must be one of {STRATEGY_MODES}, got {mode!r}")
        if scalars not in ddp.SCALAR_MODES:
            raise ValueError(f"scalars must be one of {ddp.SCALAR_MODES}, got {scalars!r}")
        if mode == "owner":
            wrapper_args = sorted(k for k in kwargs if k in _DDP_ONLY or not _strategy_arg(k))
            if wrapper_args:
                raise ValueError(
                    f"DMuonStrategy(mode='owner') builds no DDP wrapper, so it cannot take "
                    f"{wrapper_args}; pass them with mode='replicated' or drop them"
                )
        elif scalars != "all_reduce" or dedicate_options:
            raise ValueError(
                "scalars= and dedicate_options= configure owner mode; mode='replicated' keeps "
                "the DDP wrapper, which all-reduces every gradient"
            )
        self._mode = mode  # before DDPStrategy's __init__, which may set precision_plugin
        super().__init__(**kwargs)
        self._dedicate_options = {"scalars": scalars, **dict(dedicate_options or {})}
        self._dedication: Dedication | None = None
        self._collectives_broken = False  # on_exception: teardown waits for nothing
        self._root_layers: list[str] = []

    @property
    def mode(self) -> str:
        """``"owner"`` or ``"replicated"``."""
        return self._mode

    @property
    def dedication(self) -> Dedication | None:
        """The :class:`~dmuon.integrations.Dedication` of the LightningModule (owner mode,
        from ``Trainer.fit``'s setup until teardown); ``None`` otherwise."""
        return self._dedication

    def configure_ddp(self) -> None:
        """Owner mode: dedicate the LightningModule (no wrapper); replicated: wrap in DDP.

        Raises:
            ValueError: the module was dedicated by an earlier ``fit`` (a module is
                dedicated once; resume a new one from a checkpoint instead).
        """
        if self._mode == "replicated":
            super().configure_ddp()
            return
        if not isinstance(self.model, pl.LightningModule):
            raise TypeError(
                f"DMuonStrategy dedicates a LightningModule, got {type(self.model).__name__}"
            )
        if any(exchange_of(p) is not None for p in self.model.parameters()):
            # Still dedicated: an earlier fit's teardown (which undedicates) did not run;
            # dedicate would fail deep inside with "dedicated twice". Same on every rank.
            raise ValueError(
                f"this {type(self.model).__name__} is still dedicated by an earlier "
                "Trainer.fit under DMuonStrategy whose teardown did not run: call "
                "undedicate() on that strategy's dedication, or build a new module and "
                "resume with trainer.fit(new_module, ckpt_path=...)"
            )
        self._dedication = ddp.dedicate(self.model, **self._dedicate_options)
        # the layers waited for at the LightningModule's own forward pre-hook (weights it
        # holds itself), which the trainer's training_step does not run: see _enter_root
        where = wait_modules(self.model, self._dedication.exchange)
        self._root_layers = [key for key, modules in where.items() if "" in modules]
        if self._dedication.use_check is not None:
            # the check at the end of the module's own forward would never run: the
            # strategy begins it with each training_step and ends it before backward
            self._dedication.use_check.driven = True
        if self._precision_plugin is not None:
            plugin: Any = self._precision_plugin  # DMuonPrecision's attribute (any plugin)
            plugin._dmuon_dedication = self._dedication

    def _enter_root(self) -> None:
        """Owner mode: the waits of the layers whose forward pre-hook is the
        LightningModule's own, which the trainer never calls (it calls ``training_step``,
        ``validation_step``, …): weights the module holds itself would be read before
        their owners' broadcasts arrived."""
        if self._dedication is not None and self._dedication.handles:
            publication = self._dedication.exchange.publication
            for key in self._root_layers:
                publication.forward_enter(key)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """``DDPStrategy.training_step``, after the waits of :meth:`_enter_root`; under
        ``reshard_after_forward`` it begins the check that every rank ran every dedicated
        layer (ended by :meth:`backward`)."""
        self._enter_root()
        if (check := self._use_check()) is not None:
            check.begin()
        return super().training_step(*args, **kwargs)

    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """``DDPStrategy.backward``; under ``reshard_after_forward`` first the check that
        every rank ran every dedicated layer in this forward.

        Raises:
            dmuon.integrations.PartialUseError: (every rank alike) a dedicated layer ran
                on some ranks only: their backward re-gathers would pair up wrongly.
        """
        if (check := self._use_check()) is not None:
            check.end()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _use_check(self) -> PartialUseCheck | None:
        """The dedication's partial-use check, which this strategy drives (or None)."""
        return self._dedication.use_check if self._dedication is not None else None

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """``DDPStrategy.validation_step``, after the waits of :meth:`_enter_root`."""
        self._enter_root()
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """``DDPStrategy.test_step``, after the waits of :meth:`_enter_root`."""
        self._enter_root()
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """``DDPStrategy.predict_step``, after the waits of :meth:`_enter_root`."""
        self._enter_root()
        return super().predict_step(*args, **kwargs)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """As ``DDPStrategy``; in owner mode a DMuon must step the dedicated matrices.

        Raises:
            ValueError: (owner mode, every rank alike) ``configure_optimizers`` returned
                no DMuon built on the strategy's dedication: without its step each
                matrix's averaged gradient would stay on its owner rank and no weight
                would be broadcast (the second backward stopped with "a second gradient
                ... arrived after its layer was reduced", which named neither cause nor fix).
        """
        super().setup_optimizers(trainer)
        ded = self._dedication
        if ded is None:
            return
        if not any(
            isinstance(o, DMuon) and getattr(o.engine, "exchange", None) is ded.exchange
            for o in map(_unwrap, self.optimizers)
        ):
            names = [type(_unwrap(o)).__name__ for o in self.optimizers]
            raise ValueError(
                f"DMuonStrategy (owner mode) reduces each matrix's gradient to one owner "
                f"rank, whose DMuon steps it and broadcasts the new weight, but "
                f"configure_optimizers returned {names}, no DMuon on the strategy's "
                "dedication: return dmuon_optimizer(self, ...) (or DMuon(..., "
                "distributed=self.trainer.strategy.dedication)), beside any other optimizer; "
                "or train under strategy='ddp' / DMuonStrategy('replicated')"
            )

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """As ``DDPStrategy``; an optimizer other than DMuon (an AdamW over the
        all-reduced parameters, beside the DMuon) steps on finished reductions.

        In owner mode the hooks all-reduce the scalar parameters' gradients while
        backward runs, and DMuon's step waits for them. An optimizer stepped before the
        DMuon (``configure_optimizers`` returning ``[adamw, dmuon]``) would read this
        rank's own gradients, or a half-reduced bucket: the ranks' weights would drift
        apart. Its closure (forward and backward) is followed by the wait here, before
        Lightning's ``on_before_optimizer_step`` hooks, clipping and the step.
        """
        ded = self._dedication
        if ded is None or isinstance(_unwrap(optimizer), DMuon):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reductions() -> Any:
            output = closure()
            _finish_reductions(ded)
            return output

        return super().optimizer_step(optimizer, closure_then_reductions, model, **kwargs)

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin Lightning chose, clipping a DMuon with DMuon's functions."""
        plugin = self._precision_plugin
        return plugin if plugin is not None else with_dmuon_precision(Precision())

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None:
            plugin = with_dmuon_precision(plugin)
            if self._mode == "owner":
                agree_loss_scaler(plugin)
        self._precision_plugin = plugin

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the owner reductions of a gradient-accumulation micro-batch."""
        if self._dedication is None:
            with super().block_backward_sync():
                yield
            return
        with self._dedication.no_sync():
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The weights, once every rank holds the owners' latest broadcast.

        Under ``reshard_after_forward`` they are copies: the weights a rank does not own
        are freed again after the checkpoint's optimizer state is gathered.
        """
        if self._dedication is None:
            return super().lightning_module_state_dict()
        self._dedication.wait()
        sd = super().lightning_module_state_dict()
        if self._dedication.exchange.reshard_after_forward:
            sd = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in sd.items()}
        return sd

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """A DMuon's whole state on rank 0 (``{}`` elsewhere): a collective, every rank calls it.

        Owner mode: :data:`CHECKPOINT_FORMAT` (each owner's share sent to rank 0).
        Replicated mode: the optimizer's state dict with every owner's momentum in it.
        Other optimizers: as ``DDPStrategy``.
        """
        opt = _unwrap(optimizer)
        if not isinstance(opt, DMuon) or opt.mode in ("single", "sign", "sharded"):
            return super().optimizer_state(optimizer)
        if opt.mode == "replicated":
            full = gather_full_state_dict(opt)
            return full if self.is_global_zero else {}
        assert self.lightning_module is not None
        sd = full_state_dict(self.lightning_module, opt)
        if not sd:
            return {}
        return {"format": CHECKPOINT_FORMAT, "optim": sd["optim"], "dmuon": sd["dmuon"]}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Give every rank its share of the saved optimizer states (called on every rank).

        Raises:
            dmuon.integrations.checkpoint.CheckpointMismatchError: the saved state does
                not fit this optimizer (nothing is changed).
            ValueError: a DMuon state dict with another rank's share missing (a
                checkpoint written under ``strategy="ddp"`` in replicated mode): loading
                it would silently restart that momentum from zero.
        """
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer state(s), configure_optimizers "
                f"returned {len(self.optimizers)}"
            )
        pairs = [(_unwrap(o), saved) for o, saved in zip(self.optimizers, states, strict=True)]
        # Check every entry before loading any, so a refused checkpoint changes nothing.
        for opt, saved in pairs:
            if _is_full(saved) and not isinstance(opt, DMuon):
                raise TypeError(
                    f"the checkpoint holds DMuon state ({CHECKPOINT_FORMAT}) for an "
                    f"optimizer of type {type(opt).__name__}"
                )
            if isinstance(opt, DMuon) and isinstance(saved, Mapping) and not _is_full(saved):
                missing = missing_state(dict(saved))
                if missing:
                    raise ValueError(
                        f"the DMuon state in this checkpoint lacks {len(missing)} entries "
                        f"held by other ranks when it was saved (e.g. {missing[:3]}); it was "
                        "written from rank 0 only (strategy='ddp'). Loading it would restart "
                        "that momentum from zero; save checkpoints under DMuonStrategy"
                    )
        for opt, saved in pairs:
            if _is_full(saved):
                assert self.lightning_module is not None
                # The weights: those Lightning has just restored (its restore_model ran
                # before the strategy's setup, honouring strict_loading).
                full = {"model": self.lightning_module_state_dict(), "optim": saved["optim"]}
                load_full_state_dict(self.lightning_module, opt, full)  # type: ignore[arg-type]
            else:
                # Optimizer.load_state_dict (and load_full_state_dict) put the state on
                # the parameters' device: nothing to move afterwards.
                opt.load_state_dict(saved)

    def on_exception(self, exception: BaseException) -> None:
        """Note an error after which the ranks' collectives are out of step (a
        :class:`~dmuon.comm.CollectiveError`, a :class:`~dmuon.integrations.PartialUseError`):
        :meth:`teardown` then does not wait for broadcasts that may never complete."""
        if isinstance(exception, (CollectiveError, PartialUseError)):
            self._collectives_broken = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Wait for the last broadcasts (not after an error that left the ranks'
        collectives out of step: :meth:`on_exception`), remove the owner hooks and let the
        parameters go (:meth:`Dedication.undedicate
        <dmuon.integrations.Dedication.undedicate>`, not just ``remove()``: the module is no
        longer dedicated, and once the trainer's optimizer is dropped nothing keeps the
        exchange and its buckets alive), then as ``DDPStrategy``."""
        if self._dedication is not None:
            broken = self._collectives_broken
            if not broken:
                self._dedication.wait()
            self._dedication.remove(wait=not broken)
            self._dedication.exchange.undedicate()
            self._dedication = None
            if self._precision_plugin is not None:
                plugin: Any = self._precision_plugin
                plugin._dmuon_dedication = None
        super().teardown()


class DMuonPrecision:
    """What a precision plugin under :class:`DMuonStrategy` adds: DMuon's gradient
    clipping and, in owner and ``sign`` mode, DMuon's fp16 loss-scaled step.

    Lightning clips in the precision plugin's ``clip_grad_by_norm`` and
    ``clip_grad_by_value``, with :func:`torch.nn.utils.clip_grad_norm_` and
    :func:`torch.nn.utils.clip_grad_value_` over the optimizer's parameters. For a
    :class:`~dmuon.optim.DMuon` these two methods call
    :func:`dmuon.optim.clip_grad_norm_` and :func:`dmuon.optim.clip_grad_value_`
    instead, which clip the averaged gradient whatever the mode, and
    ``clip_gradients`` dispatches a DMuon to them (see its docstring); any other
    optimizer goes to the plugin's own methods.

    With an fp16 loss scaler (``precision="16-mixed"``) and a DMuon in owner or
    ``sign`` mode, :meth:`optimizer_step` unscales through
    :meth:`dmuon.optim.DMuon.unscale_` (which finishes the reductions to the owners
    first) before Lightning's ``on_before_optimizer_step`` hooks and clipping, then
    lets the scaler step and update (see :mod:`dmuon.optim.loss_scaling`). The scaler
    must be a ``ShardedGradScaler`` over the world: :class:`DMuonStrategy` in owner
    mode gives ``MixedPrecision`` one in place of Lightning's ``GradScaler``.
    :func:`with_dmuon_precision` puts this class in front of a plugin's own class; it
    changes nothing else.

    Examples:
        >>> import torch
        >>> from lightning.pytorch.plugins.precision import MixedPrecision, Precision
        >>> from dmuon.integrations.lightning import with_dmuon_precision
        >>> from dmuon.optim import DMuon
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> w.grad = torch.full((2, 2), 2.0)  # norm 4
        >>> with_dmuon_precision(Precision()).clip_grad_by_norm(DMuon([w]), 1.0)
        >>> round(w.grad.norm().item(), 4)
        1.0
    """

    def optimizer_step(
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """A DMuon's fp16 loss-scaled step in owner or ``sign`` mode; else the plugin's.

        As Lightning's ``MixedPrecision.optimizer_step``, with ``scaler.unscale_(opt)``
        replaced by ``opt.unscale_(scaler)``: the closure (forward, backward), the
        unscaling (every rank's Inf flags summed by the ``ShardedGradScaler``), the
        ``on_before_optimizer_step`` hooks and clipping (on unscaled gradients), then
        ``scaler.step`` (which skips the step on every rank alike when a rank found an
        Inf) and ``scaler.update``. A backward that the automatic optimization skipped
        (the closure returned ``None``) is neither unscaled nor stepped.

        Raises:
            TypeError: (owner, ``sign`` mode) the plugin's scaler is not a
                ``ShardedGradScaler`` (see :meth:`dmuon.optim.DMuon.unscale_`).
        """
        opt = _unwrap(optimizer)
        scaler = _agreed_scaler(self, opt)
        if scaler is None or not isinstance(opt, DMuon):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward and not opt.unscaled:
            opt.unscale_(scaler)
        self._after_closure(model, optimizer)  # type: ignore[attr-defined]
        if skipped_backward:
            return closure_result
        step_output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return step_output

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip a DMuon's gradients by norm or by value (DMuon's functions).

        Lightning's ``MixedPrecision`` refuses to clip for an optimizer that unscales
        gradients itself (``_step_supports_amp_scaling``, which DMuon's owner and sign
        modes set so that a loss scaler calls their step on every rank), so a DMuon
        is clipped here directly. With an fp16 scaler in those modes the gradients
        are unscaled first (:meth:`dmuon.optim.DMuon.unscale_`) unless they already
        are: under automatic optimization :meth:`optimizer_step` has unscaled them,
        under manual optimization (``self.clip_gradients`` before ``opt.step()``) it
        happens here, once per step.
        """
        opt = _unwrap(optimizer)
        if not isinstance(opt, DMuon):
            # another optimizer's gradients (the all-reduced scalars under DMuonStrategy's
            # owner mode) are clipped once their reductions have finished
            ded = getattr(self, "_dmuon_dedication", None)
            if ded is not None:
                _finish_reductions(ded)
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]
            return
        if clip_val <= 0:
            return
        scaler = _agreed_scaler(self, opt)
        if scaler is not None and not opt.unscaled:
            opt.unscale_(scaler)
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        else:
            self.clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        opt = _unwrap(optimizer)
        if isinstance(opt, DMuon):
            clip_grad_norm_(opt, float(clip_val))
        else:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        opt = _unwrap(optimizer)
        if isinstance(opt, DMuon):
            clip_grad_value_(opt, float(clip_val))
        else:
            super().clip_grad_by_value(optimizer, clip_val)  # type: ignore[misc]

    def __reduce__(self) -> tuple[Any, ...]:
        # The class is made per plugin class (below): pickle the plugin as its own class
        # and put the clipping back in front when it is loaded (spawned processes); its
        # state goes through the plugin class's own __getstate__/__setstate__.
        base = type(self).__bases__[1]
        getstate = getattr(super(), "__getstate__", None)  # object has one from Python 3.11
        state = getstate() if getstate is not None else self.__dict__
        return (_new_with_precision, (base,), state)


_PRECISION_CLASSES: dict[type[Precision], type[Precision]] = {}


def _precision_class(base: type[Precision]) -> type[Precision]:
    """``DMuonPrecision<Base>(DMuonPrecision, Base)``, made once per plugin class."""
    if base not in _PRECISION_CLASSES:
        _PRECISION_CLASSES[base] = type(
            f"DMuonPrecision{base.__name__}",
            (DMuonPrecision, base),
            # __qualname__: Lightning keys a checkpoint's precision state by it, so a
            # checkpoint of strategy="ddp" resumes under DMuonStrategy with its loss scale
            {"__module__": __name__, "__qualname__": base.__qualname__, "__doc__": base.__doc__},
        )
    return _PRECISION_CLASSES[base]


def with_dmuon_precision(plugin: Precision) -> Precision:
    """``plugin``, clipping a DMuon's gradients with DMuon's functions (:class:`DMuonPrecision`).

    The plugin object is kept (Lightning and the user may hold it): its class becomes a
    subclass of its own class with :class:`DMuonPrecision` in front, so ``isinstance``
    checks against the plugin's class still hold and everything but the clipping
    methods is the plugin's. A plugin that has the clipping already is returned as is.

    Examples:
        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> from dmuon.integrations.lightning import DMuonPrecision, with_dmuon_precision
        >>> plugin = with_dmuon_precision(MixedPrecision("bf16-mixed", "cpu"))
        >>> isinstance(plugin, MixedPrecision), isinstance(plugin, DMuonPrecision)
        (True, True)
    """
    if not isinstance(plugin, Precision):
        raise TypeError(f"expected a Lightning Precision plugin, got {type(plugin).__name__}")
    if not isinstance(plugin, DMuonPrecision):
        plugin.__class__ = _precision_class(type(plugin))
    return plugin


def agree_loss_scaler(plugin: Precision) -> Precision:
    """``plugin``, its fp16 loss scaler a ``ShardedGradScaler`` over the world.

    Lightning's ``MixedPrecision("16-mixed")`` holds a ``torch.amp.GradScaler``, which
    looks for Inf/NaN in this rank's gradients only. In owner mode each rank holds
    the averaged gradients of the matrices it owns, so the ranks would skip steps and
    scale their losses differently; DMuon's owner-mode step refuses such a scaler
    (see :mod:`dmuon.optim.loss_scaling`). This puts a
    :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` on the same
    device with the same scale, growth and backoff factors, growth interval and
    growth tracker (its ``state_dict``) in its place; it sums the ranks' Inf flags.
    :class:`DMuonStrategy` in owner mode calls this on the plugin Lightning picks. A
    plugin without a scaler, or with a ``ShardedGradScaler`` already, is unchanged;
    so is one whose scaler is disabled.

    Examples:
        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> from dmuon.integrations.lightning import agree_loss_scaler
        >>> plugin = agree_loss_scaler(MixedPrecision("16-mixed", "cpu"))
        >>> type(plugin.scaler).__name__, plugin.scaler.get_scale()
        ('ShardedGradScaler', 65536.0)
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = getattr(plugin, "scaler", None)
    if not isinstance(plugin, MixedPrecision) or not isinstance(scaler, torch.amp.GradScaler):
        return plugin
    if isinstance(scaler, ShardedGradScaler) or not scaler.is_enabled():
        return plugin
    # process_group=None: the world when it is used (torch's default is the world group
    # object as of import, which a pickled plugin, as for spawned processes, cannot carry)
    agreed = ShardedGradScaler(device=plugin.device, process_group=None)
    agreed.load_state_dict(scaler.state_dict())
    plugin.scaler = agreed
    return plugin


def _new_with_precision(base: type[Precision]) -> Precision:
    """An empty ``base`` plugin with :class:`DMuonPrecision` in front (pickle then sets
    its state)."""
    plugin: Precision = object.__new__(base)
    return with_dmuon_precision(plugin)


def _agreed_scaler(plugin: Any, opt: Optimizer) -> torch.amp.GradScaler | None:
    """The plugin's fp16 loss scaler when it is enabled and ``opt`` is a DMuon whose ranks
    must agree on its skips (owner, ``sign`` mode); else ``None``."""
    scaler = getattr(plugin, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return None
    return scaler if isinstance(opt, DMuon) and opt.mode in AGREED_MODES else None


def _finish_reductions(ded: Dedication) -> None:
    """Finish this step's gradient reductions (owner mode) when a backward started them:
    every all-reduced gradient is then the average on every rank. DMuon's step, which
    waits for them too, finds them done. A no-op after that step (nothing pending)."""
    reduction = ded.exchange.reduction
    if reduction.started():
        reduction.wait_all_reduced()


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _is_full(saved: Any) -> bool:
    return isinstance(saved, Mapping) and saved.get("format") == CHECKPOINT_FORMAT


def _strategy_arg(name: str) -> bool:
    return name in inspect.signature(DDPStrategy.__init__).parameters


def dmuon_optimizer(module: pl.LightningModule, **kwargs: Any) -> DMuon:
    """DMuon for ``module``'s ``configure_optimizers``, in the mode its Trainer calls for.

    Under :class:`DMuonStrategy` (owner mode) the optimizer takes the strategy's
    dedication; under Lightning's DDP strategy (the model wrapped in
    ``DistributedDataParallel``, or ``DMuonStrategy(mode="replicated")``) it runs in
    ``replicated`` mode; with no Trainer or one process, in ``single`` mode. So the
    same LightningModule trains under each strategy, and in a plain loop. Other
    strategies get DMuon's own choice (``sharded`` for DTensor parameters).

    Args:
        module: the LightningModule (its parameters go through
            :func:`dmuon.optim.param_groups`).
        **kwargs: arguments of :class:`dmuon.optim.DMuon` (``lr``, ``adamw_lr``, ...);
            not ``mode`` or ``distributed``, which this function chooses.

    Returns:
        The :class:`~dmuon.optim.DMuon`.

    Raises:
        ValueError: ``mode`` or ``distributed`` in ``kwargs``; or a
            :class:`DMuonStrategy` in owner mode that has not dedicated the module
            yet (call it from ``configure_optimizers``).

    Examples:
        >>> import lightning as L
        >>> import torch
        >>> from dmuon.integrations.lightning import dmuon_optimizer
        >>> class Model(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        ...     def configure_optimizers(self):
        ...         return dmuon_optimizer(self, lr=0.02)
        >>> Model().configure_optimizers().mode  # no Trainer: one process
        'single'
    """
    chosen = sorted(k for k in ("mode", "distributed") if k in kwargs)
    if chosen:
        raise ValueError(
            f"dmuon_optimizer chooses {chosen} from the Trainer's strategy; build "
            "dmuon.optim.DMuon yourself to set them"
        )
    trainer = module._trainer
    strategy = trainer.strategy if trainer is not None else None
    groups = param_groups(module)
    if isinstance(strategy, DMuonStrategy) and strategy.mode == "owner":
        if strategy.dedication is None:
            raise ValueError(
                "DMuonStrategy has not dedicated the module yet: call dmuon_optimizer from "
                "configure_optimizers, which Lightning runs after the strategy's setup"
            )
        return DMuon(groups, distributed=strategy.dedication, **kwargs)
    if strategy is not None and isinstance(strategy.model, DistributedDataParallel):
        return DMuon(groups, mode="replicated", **kwargs)
    return DMuon(groups, **kwargs)


if "dmuon" not in StrategyRegistry:
    StrategyRegistry.register(
        "dmuon",
        DMuonStrategy,
        description="DMuon owner mode: matrices reduced to their owner rank, no DDP wrapper",
    )


def __getattr__(name: str) -> Any:
    """``MODES``: the old name of :data:`STRATEGY_MODES` (deprecated; removed next release)."""
    if name == "MODES":
        warnings.warn(
            "dmuon.integrations.lightning.MODES was renamed STRATEGY_MODES (dmuon.optim's "
            "MODES are the optimizer's execution modes)",
            DeprecationWarning,
            stacklevel=2,
        )
        return STRATEGY_MODES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
