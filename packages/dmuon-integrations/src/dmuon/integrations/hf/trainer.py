"""``DMuonTrainer``: ``transformers.Trainer`` that trains with DMuon and checkpoints all of it.

Two things differ from a stock ``Trainer``:

* :meth:`DMuonTrainer.create_optimizer` builds :class:`~dmuon.optim.DMuon` from
  :func:`dmuon.optim.param_groups` of the model and the ``TrainingArguments``
  (:func:`~dmuon.integrations.hf.build_dmuon`); Trainer's LR schedulers, gradient
  accumulation, gradient clipping and DDP launch work unchanged around it.
* Checkpoints hold the whole optimizer state. Under torchrun each matrix's
  momentum lives on its owner rank only (``replicated`` mode), while Trainer
  writes ``optimizer.pt`` from the main process alone. Saving therefore first
  gathers every owner's state on every rank
  (:func:`~dmuon.integrations.hf.gather_full_state_dict`, a collective run by all
  ranks inside Trainer's save), and loading refuses a file with another rank's
  share missing (a checkpoint of a plain ``Trainer`` under torchrun) on every rank
  alike, instead of silently restarting that momentum from zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dmuon.integrations.extras import raise_missing_extra
from dmuon.integrations.hf.factory import build_dmuon
from dmuon.integrations.hf.state import gather_full_state_dict, missing_state, unwrap_optimizer
from dmuon.optim import DMuon

try:
    from transformers import Trainer
except ModuleNotFoundError as err:  # named: the extra to install
    raise_missing_extra(err, __name__, "hf")
    raise

__all__ = ["DMuonTrainer"]


class DMuonTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is DMuon (see the module docstring).

    Args:
        *args: ``Trainer``'s positional arguments.
        dmuon_options: DMuon arguments on top of those mapped from
            ``TrainingArguments`` (``rule``, ``momentum``, ``ns_steps``, ``mode``, ...;
            see :func:`~dmuon.integrations.hf.dmuon_kwargs`).
        dmuon_groups: parameter groups to use instead of
            :func:`dmuon.optim.param_groups` of the model.
        **kwargs: ``Trainer``'s keyword arguments (not ``optimizer_cls_and_kwargs``).

    Raises:
        ValueError: ``optimizer_cls_and_kwargs`` is given (DMuonTrainer builds DMuon).

    Examples:
        >>> import tempfile, torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                   num_hidden_layers=1, num_attention_heads=2)
        >>> model = LlamaForCausalLM(cfg)
        >>> data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 4
        >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, learning_rate=1e-2,
        ...                          per_device_train_batch_size=2, use_cpu=True,
        ...                          report_to=[], save_strategy="no", disable_tqdm=True)
        >>> import contextlib, io
        >>> with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints its logs
        ...     trainer = DMuonTrainer(model=model, args=args, train_dataset=data,
        ...                            dmuon_options={"momentum": 0.9})
        ...     result = trainer.train()
        >>> opt = unwrap_optimizer(trainer.optimizer)  # inside accelerate's wrapper
        >>> type(opt).__name__, opt.mode, opt.param_groups[0]["momentum"]
        ('DMuon', 'single', 0.9)
    """

    def __init__(
        self,
        *args: Any,
        dmuon_options: dict[str, Any] | None = None,
        dmuon_groups: Any = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(
                "DMuonTrainer builds DMuon itself: pass DMuon's arguments as dmuon_options=, "
                "or use a stock Trainer with optimizer_cls_and_kwargs"
            )
        self.dmuon_options = dict(dmuon_options or {})
        self.dmuon_groups = dmuon_groups
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model: Any = None) -> Any:
        """Build DMuon (once) for ``model`` (default ``self.model``) from ``self.args``.

        Raises:
            ValueError: Trainer's DeepSpeed launch (DMuon meets DeepSpeed through
                ``dmuon.integrations.deepspeed``, see the DeepSpeed guide), FSDP, or a
                mode the launch cannot run.
        """
        if getattr(self, "optimizer", None) is None:
            if getattr(self, "is_deepspeed_enabled", False):
                raise ValueError(
                    "DMuonTrainer does not build the optimizer for Trainer's DeepSpeed launch: "
                    "ZeRO hands a client optimizer flat partitions of the parameters, which "
                    "would orthogonalise matrices in pieces. Build the engine with "
                    "dmuon.integrations.deepspeed (see the DeepSpeed guide for the stages it "
                    "serves)"
                )
            opt_model = self.model if model is None else model
            if opt_model is None:
                raise ValueError("DMuonTrainer needs a model to build the optimizer for")
            self.optimizer = build_dmuon(
                opt_model, self.args, groups=self.dmuon_groups, **self.dmuon_options
            )
        return self.optimizer

    def _dmuon(self) -> DMuon | None:
        try:
            return unwrap_optimizer(self.optimizer)
        except TypeError:
            return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Trainer calls this on every rank and writes optimizer.state_dict() on the main
        # process only: gather first (all ranks), then let Trainer write the full state.
        opt = self._dmuon()
        if opt is None or opt.engine.world_size == 1:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        full = gather_full_state_dict(opt)
        with _state_dict_replaced(opt, full):
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = self._dmuon()
        if opt is None or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return

        def check(_: Any, state_dict: dict[str, Any]) -> None:
            # The same file on every rank: every rank raises alike, none is left waiting.
            missing = missing_state(state_dict)
            if missing:
                raise ValueError(
                    f"the optimizer state in checkpoint {checkpoint!r} lacks {len(missing)} "
                    f"entries held by other ranks when it was written (e.g. {missing[:3]}): "
                    "it was saved from one rank's share (a plain Trainer under torchrun). "
                    "Loading it would restart that momentum from zero; save checkpoints with "
                    "DMuonTrainer, which gathers the full state"
                )

        handle = opt.register_load_state_dict_pre_hook(check)
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            handle.remove()


@contextlib.contextmanager
def _state_dict_replaced(opt: DMuon, full: dict[str, Any]) -> Iterator[None]:
    """``opt.state_dict()`` returns ``full`` (with the live ``"distributed"`` facts)."""

    def hook(_: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        return full

    handle = opt.register_state_dict_post_hook(hook)
    try:
        yield
    finally:
        handle.remove()
