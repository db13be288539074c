"""DMuon from ``TrainingArguments``: the hyperparameter mapping and Trainer's optimizer factory.

``TrainingArguments`` → :class:`~dmuon.optim.DMuon`:

==============================  =====================================================
``learning_rate``               ``lr`` (matrix groups) and the scalar groups' lr
``weight_decay``                ``weight_decay`` (matrices) and ``adamw_weight_decay``
                                (embeddings and head; norms and biases take none, as
                                in Trainer's own grouping)
``adam_beta1``, ``adam_beta2``  ``adamw_betas`` of the scalar groups
``adam_epsilon``                ``adamw_eps``
``optim_args``                  any DMuon argument, ``"momentum=0.9, ns_steps=3"``
                                (see :func:`dmuon_kwargs`)
==============================  =====================================================

Every other DMuon argument (``rule``, ``momentum``, ``ns_steps``, ...) is passed as
a keyword and wins over the mapping and over ``optim_args``. The default
``adjust_lr="match_rms_adamw"`` gives every matrix update the RMS of an AdamW update;
even so, the best matrix lr measured on the project's small GPTs was about 10× AdamW's
best (docs: Algorithms, "Where to start"): set ``learning_rate`` to 10× what worked with
Trainer's AdamW and keep that for the scalars with ``dmuon_options={"adamw_lr": ...}``.

The execution mode follows the launch: one process is ``single``; under torchrun
Trainer wraps the model in DDP, which all-reduces every gradient, so the mode is
``replicated`` (each matrix orthogonalised once, on its owner, then all-gathered).
Owner mode is not offered here: it replaces DDP (``dmuon.integrations.ddp.dedicate``)
and Trainer always wraps the model in DDP itself.
"""

from __future__ import annotations

import ast
from typing import Any

import torch.distributed as dist
from torch import nn

from dmuon.optim import DMuon, param_groups
from dmuon.optim.engine.params import is_dtensor

__all__ = ["DMuonFactory", "build_dmuon", "dmuon_kwargs", "optimizer_cls_and_kwargs"]

# Modes a Trainer launch can run: Trainer owns the DDP wrapping.
TRAINER_MODES = ("single", "replicated")


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def dmuon_kwargs(args: Any, **overrides: Any) -> dict[str, Any]:
    """DMuon's keyword arguments from ``TrainingArguments`` (see the module table).

    ``args.optim_args`` (``--optim_args`` on a command line ``HfArgumentParser``
    reads) holds DMuon arguments as ``"name=value, ..."``: each value is read as a
    Python literal (``0.9``, ``3``, ``False``, ``None``, ``(0.9, 0.99)``) or else
    taken as a string (``rule=normuon``, ``ns_compute_dtype=float32``). They replace
    the mapped arguments; ``overrides`` replace both. A name DMuon does not take is
    refused when the optimizer is built, as ``DMuon(name=...)`` is.

    Args:
        args: a ``transformers.TrainingArguments`` (anything with its attributes).
        **overrides: DMuon arguments that replace the mapped ones and ``optim_args``.

    Returns:
        The keyword arguments, with ``mode`` set for the launch (``"replicated"``
        when a process group of more than one rank is initialised, else
        ``"single"``) unless ``overrides`` names one.

    Examples:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(learning_rate=3e-4, weight_decay=0.1, adam_beta1=0.9,
        ...                        adam_beta2=0.98, adam_epsilon=1e-8)
        >>> kw = dmuon_kwargs(args, momentum=0.9)
        >>> kw["lr"], kw["adamw_betas"], kw["weight_decay"], kw["momentum"], kw["mode"]
        (0.0003, (0.9, 0.98), 0.1, 0.9, 'single')
        >>> args.optim_args = "momentum=0.8, ns_steps=3, rule=normuon, adamw_betas=(0.9, 0.99)"
        >>> kw = dmuon_kwargs(args, ns_steps=4)
        >>> kw["momentum"], kw["ns_steps"], kw["rule"], kw["adamw_betas"]
        (0.8, 4, 'normuon', (0.9, 0.99))

    Raises:
        ValueError: an ``optim_args`` item that is not ``name=value``.
    """
    kwargs: dict[str, Any] = {
        "lr": float(args.learning_rate),
        "weight_decay": float(args.weight_decay),
        "adamw_betas": (float(args.adam_beta1), float(args.adam_beta2)),
        "adamw_eps": float(args.adam_epsilon),
        "adamw_weight_decay": float(args.weight_decay),
        "mode": "replicated" if _world_size() > 1 else "single",
    }
    kwargs.update(_parse_optim_args(getattr(args, "optim_args", None)))
    kwargs.update(overrides)
    return kwargs


def _parse_optim_args(text: str | None) -> dict[str, Any]:
    """``TrainingArguments.optim_args`` as keyword arguments (see :func:`dmuon_kwargs`).

    The text is read by Python's own parser as the keyword arguments of a call,
    ``f(<text>)``, so brackets, quotes and commas inside values mean what they mean in
    Python. A value is a literal (:func:`ast.literal_eval`: numbers, strings, tuples,
    ``True``...) or else the text of the expression as written: a bare word
    (``rule=normuon``, ``ns_compute_dtype=float32``) or a dotted name
    (``torch.float32``) arrives as a string.

    Raises:
        ValueError: the text is not ``name=value`` items separated by commas, or names
            an argument twice (the item or the whole text named, with what would be
            right).

    Examples:
        >>> _parse_optim_args("momentum=0.9, nesterov=False, adamw_betas=(0.9, 0.99), rule=normuon")
        {'momentum': 0.9, 'nesterov': False, 'adamw_betas': (0.9, 0.99), 'rule': 'normuon'}
        >>> _parse_optim_args("rule=sign-muon, ns_compute_dtype=torch.float32,")
        {'rule': 'sign-muon', 'ns_compute_dtype': 'torch.float32'}
        >>> _parse_optim_args(None)
        {}
    """
    if not text or not text.strip():
        return {}
    source = f"f({text})"
    hint = "write DMuon's arguments as 'momentum=0.9, ns_steps=3'"
    try:
        call = ast.parse(source, mode="eval").body
    except SyntaxError as err:
        raise ValueError(
            f"optim_args={text!r} is not name=value items separated by commas ({err.msg}); {hint}"
        ) from None
    assert isinstance(call, ast.Call)  # f(...) parses as a call or not at all
    for arg in call.args:  # a positional item: no name
        item = ast.get_source_segment(source, arg)
        raise ValueError(
            f"optim_args item {item!r} is not name=value (in optim_args={text!r}); {hint}"
        )
    out: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg in out:
            raise ValueError(
                f"optim_args names {kw.arg!r} twice (in optim_args={text!r}); give it once"
            )
        if kw.arg is None:  # **mapping
            item = ast.get_source_segment(source, kw)
            raise ValueError(
                f"optim_args item {item!r} is not name=value (in optim_args={text!r}); {hint}"
            )
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            out[kw.arg] = ast.get_source_segment(source, kw.value)  # a bare word, as written
    return out


def build_dmuon(
    model: nn.Module,
    args: Any = None,
    *,
    groups: Any = None,
    **overrides: Any,
) -> DMuon:
    """A :class:`~dmuon.optim.DMuon` for ``model`` configured from ``args``.

    Call it on every rank (in ``replicated`` mode the constructor checks that the
    ranks' models agree, a collective).

    Args:
        model: the model Trainer trains (``trainer.model``).
        args: the ``TrainingArguments`` (``None``: DMuon's own defaults).
        groups: parameter groups (default :func:`dmuon.optim.param_groups` of ``model``).
        **overrides: DMuon arguments (``rule``, ``momentum``, ``mode``, ...).

    Returns:
        The optimizer.

    Raises:
        ValueError: a mode a Trainer launch cannot run (``owner``, ``sharded``,
            ``sign``), or FSDP2-sharded (DTensor) parameters; each message says what
            to do instead.

    Examples:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> args = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, adam_beta1=0.9,
        ...                        adam_beta2=0.95, adam_epsilon=1e-8)
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> opt = build_dmuon(model, args)
        >>> opt.mode, [g["name"] for g in opt.param_groups]
        ('single', ['matrix', 'scalar: norms, biases and scalars'])
    """
    kwargs = dmuon_kwargs(args, **overrides) if args is not None else dict(overrides)
    kwargs.setdefault("mode", "replicated" if _world_size() > 1 else "single")
    mode = kwargs["mode"]
    if mode not in TRAINER_MODES:
        raise ValueError(
            f"mode={mode!r} cannot run under the Hugging Face Trainer, which wraps the model "
            f"in DDP itself (every gradient arrives all-reduced); use one of {TRAINER_MODES} "
            "(the default picks it), or train owner mode with dmuon.integrations.ddp.dedicate "
            "in your own loop"
        )
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            "the model's parameters are FSDP2 DTensors (Trainer's FSDP path); "
            "dmuon.integrations.hf supports Trainer's single-process and DDP launches — use "
            "dmuon.integrations.fsdp.dedicate in your own loop for FSDP2"
        )
    if groups is None:
        groups = param_groups(model)
    return DMuon(groups, **kwargs)


class DMuonFactory:
    """DMuon as Trainer's ``optimizer_cls_and_kwargs`` (see :func:`optimizer_cls_and_kwargs`).

    Trainer calls a factory that is not an ``Optimizer`` class as
    ``DMuonFactory()(model, **kwargs)`` (transformers with optimizer factories); older
    Trainers call ``DMuonFactory(model, **kwargs)`` when the kwargs hold ``model``.
    Both build :func:`build_dmuon` ``(model, **kwargs)``.

    Examples:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> args = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, adam_beta1=0.9,
        ...                        adam_beta2=0.95, adam_epsilon=1e-8)
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> cls, kwargs = optimizer_cls_and_kwargs(args, momentum=0.9)
        >>> opt = cls()(model, **kwargs)  # what Trainer.create_optimizer does
        >>> type(opt).__name__, opt.param_groups[0]["momentum"]
        ('DMuon', 0.9)
        >>> # A Trainer without factories pops kwargs["model"] and calls the class with it:
        >>> _, kwargs = optimizer_cls_and_kwargs(args, model=model, momentum=0.9)
        >>> model_arg = kwargs.pop("model")
        >>> type(DMuonFactory(model_arg, **kwargs)).__name__
        'DMuon'
    """

    def __new__(cls, model: nn.Module | None = None, /, **kwargs: Any) -> Any:
        if model is None:
            return super().__new__(cls)
        # An older Trainer passes kwargs["model"] positionally: build the optimizer now.
        return build_dmuon(model, **kwargs)

    def __call__(self, model: nn.Module, /, **kwargs: Any) -> DMuon:
        """Build the optimizer for ``model`` (Trainer's ``opt_model``)."""
        kwargs.pop("model", None)  # Trainer's own opt_model wins
        return build_dmuon(model, **kwargs)


def optimizer_cls_and_kwargs(
    args: Any, model: nn.Module | None = None, **overrides: Any
) -> tuple[type[DMuonFactory], dict[str, Any]]:
    """``(factory, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    The factory builds DMuon from :func:`dmuon.optim.param_groups` of the model
    Trainer trains and from ``args`` (see :func:`dmuon_kwargs`). Under torchrun the
    optimizer state of each matrix lives on its owner rank only, and a plain
    ``Trainer`` writes ``optimizer.pt`` from the main process: use
    :class:`~dmuon.integrations.hf.DMuonTrainer`, which gathers the full state
    first, whenever you save checkpoints with more than one rank.

    Args:
        args: the ``TrainingArguments``.
        model: the model; only needed by Trainers without optimizer factories,
            which pass ``kwargs["model"]`` in place of the parameter groups.
        **overrides: DMuon arguments (``rule``, ``momentum``, ...).

    Returns:
        ``(DMuonFactory, kwargs)``.

    Examples:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, adam_beta1=0.9,
        ...                        adam_beta2=0.95, adam_epsilon=1e-8)
        >>> cls, kwargs = optimizer_cls_and_kwargs(args, rule="normuon")
        >>> cls.__name__, kwargs["rule"]
        ('DMuonFactory', 'normuon')
    """
    kwargs: dict[str, Any] = {"args": args, **overrides}
    if model is not None:
        kwargs["model"] = model
    return DMuonFactory, kwargs
