"""DMuon as the client optimizer of ``deepspeed.initialize``, for the ZeRO stages it serves whole.

One call replaces ``deepspeed.initialize``::

    from dmuon.integrations import deepspeed as dmuon_ds

    engine, optimizer, _, _ = dmuon_ds.initialize(model, config, lr=0.02)
    for x, y in data:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()

Muon orthogonalises whole matrices; a matrix that reaches the optimizer in pieces
is silently mis-orthogonalised. What each ZeRO stage does to the client optimizer's
parameters decides what can be served (the matrix is backed by
``tests-integration/test_deepspeed.py``):

=========  ==================================================  ==============================
stage      what DeepSpeed does                                 DMuon
=========  ==================================================  ==============================
0          all-reduces every gradient, calls ``step()``        ``mode="replicated"``; or
                                                               ``mode="owner"``: DMuon's hooks
                                                               replace that all-reduce
1, 2       flattens each param group, one slice per rank       ``mode="owner"``: the matrices
                                                               are dedicated to owners, ZeRO
                                                               partitions only the scalars
3          partitions the parameters themselves                refused
=========  ==================================================  ==============================

Refused combinations raise :class:`UnsupportedConfigError` (a ``ValueError``) on every
rank before any collective, naming the supported ones: stage 3 (every parameter is
partitioned, including the matrices); ``replicated`` at stage 1/2 (the matrices would
be sliced); fp16/bf16 (DeepSpeed's mixed-precision
wrappers flatten the master weights); an ``"optimizer"`` section; CPU offload; and in
owner mode at stage 1/2 gradient clipping (ZeRO would clip the scalars by their norm
alone; at stage 0 DMuon clips by the global norm, :func:`dmuon.optim.clip_grad_norm_`).
Gradient accumulation works in every mode: in owner mode the owners' reductions run
in the backward of the accumulation boundary only.

DeepSpeed is imported when :func:`initialize` runs, so ``dmuon.integrations``
imports without it.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm import layer_key, plan_owners
from dmuon.integrations import ddp
from dmuon.integrations.dedication import Dedication, build_dedication
from dmuon.integrations.deepspeed_checkpoint import load_checkpoint, save_checkpoint
from dmuon.integrations.deepspeed_optimizer import ZeroClientOptimizer, dmuon_of
from dmuon.optim import (
    RULES,
    SCALAR_ALGORITHMS,
    DMuon,
    clip_grad_norm_,
    get_scalar_rule,
    param_groups,
)
from dmuon.optim.engine import DEFAULT_PACK_MB
from dmuon.optim.group_options import renamed_rule_key

__all__ = [
    "SUPPORTED",
    "UnsupportedConfigError",
    "ZeroClientOptimizer",
    "check_config",
    "dmuon_of",
    "initialize",
    "load_checkpoint",
    "save_checkpoint",
]

SUPPORTED: dict[int, tuple[str, ...]] = {
    0: ("replicated", "owner"),
    1: ("owner",),
    2: ("owner",),
}
"""ZeRO stage → the DMuon modes served at that stage (the first is the default)."""


class UnsupportedConfigError(ValueError):
    """A DeepSpeed config (stage × mode, precision, ...) DMuon cannot serve correctly.

    Examples:
        >>> try:
        ...     check_config({"zero_optimization": {"stage": 3}})
        ... except UnsupportedConfigError as e:
        ...     print(str(e).split(":")[0])
        ZeRO stage 3 is not supported by DMuon
    """


def _supported_text() -> str:
    return ", ".join(f"stage {s} (mode={' or '.join(map(repr, m))})" for s, m in SUPPORTED.items())


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(
            "config must be a dict or the path of a DeepSpeed JSON config, "
            f"got {type(config).__name__}"
        )
    return copy.deepcopy(dict(config))


def check_config(
    config: Mapping[str, Any] | str | os.PathLike[str], mode: str | None = None
) -> tuple[int, str]:
    """The ZeRO stage of ``config`` and the DMuon mode that serves it, or an error.

    Pure: no collective, so a refused config raises on every rank alike.

    Args:
        config: a DeepSpeed config (dict or JSON path).
        mode: ``"replicated"`` or ``"owner"``; ``None`` takes the stage's default
            (:data:`SUPPORTED`).

    Returns:
        ``(stage, mode)``.

    Raises:
        UnsupportedConfigError: the stage, the mode at that stage, or another setting
            cannot be served (the message names what is supported).

    Examples:
        >>> check_config({"zero_optimization": {"stage": 2}})
        (2, 'owner')
        >>> check_config({"train_batch_size": 8})
        (0, 'replicated')
    """
    cfg = _load(config)
    zero = cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage not in SUPPORTED:
        raise UnsupportedConfigError(
            f"ZeRO stage {stage} is not supported by DMuon: supported are {_supported_text()}.\n"
            "ZeRO-3 partitions the parameters themselves, so no rank holds a whole matrix "
            "to orthogonalise; use stage 1 or 2 (DMuon owns the matrices, ZeRO partitions "
            "the rest), or FSDP2 with dmuon.integrations.fsdp.dedicate"
        )
    mode = SUPPORTED[stage][0] if mode is None else mode
    if mode not in SUPPORTED[stage]:
        why = "ZeRO-1/2 would hand DMuon flat slices of the matrices"
        if mode not in ("replicated", "owner"):
            why = "DMuon's modes under DeepSpeed are 'replicated' and 'owner'"
        raise UnsupportedConfigError(
            f"mode={mode!r} is not supported at ZeRO stage {stage} ({why}): supported are "
            f"{_supported_text()}"
        )
    for key in ("fp16", "bf16", "bfloat16"):  # DeepSpeed reads "bfloat16" without "bf16"
        if (cfg.get(key) or {}).get("enabled", False):
            raise UnsupportedConfigError(
                f"{key}.enabled is not supported with DMuon: DeepSpeed's mixed-precision "
                "optimizer wrappers flatten the fp32 master weights, which would hand DMuon "
                "pieces of matrices; train in fp32 (or autocast in the model) with "
                f"{_supported_text()}"
            )
    if "optimizer" in cfg:
        raise UnsupportedConfigError(
            "the config has an 'optimizer' section; DMuon is the client optimizer, drop the section"
        )
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key) and (zero[key].get("device", "none") not in ("none", None)):
            raise UnsupportedConfigError(
                f"zero_optimization.{key} is not supported with DMuon (ZeRO-Offload runs "
                "DeepSpeed's own CPU optimizer)"
            )
    if zero.get("cpu_offload"):  # DeepSpeed's older spelling of offload_optimizer to the CPU
        raise UnsupportedConfigError(
            "zero_optimization.cpu_offload is not supported with DMuon (ZeRO-Offload runs "
            "DeepSpeed's own CPU optimizer)"
        )
    if mode == "owner" and stage > 0 and _clipping(cfg, absent=0.0) > 0.0:
        raise UnsupportedConfigError(
            f"gradient_clipping is not supported at ZeRO stage {stage}: ZeRO would clip the "
            "scalars by their own norm, without the matrices held by DMuon's owners; drop it, "
            "or use stage 0 (owner mode: DMuon clips by the global norm; replicated: "
            "DeepSpeed clips the averaged gradients)"
        )
    if mode == "owner" and stage > 0 and cfg.get("scheduler"):
        raise UnsupportedConfigError(
            _SCHEDULER_REFUSAL.format(stage=stage, what="a 'scheduler' section")
        )
    if mode == "owner" and not cfg.get("managed_gradient_accumulation", True):
        raise UnsupportedConfigError(
            "managed_gradient_accumulation=false is not supported in owner mode: DeepSpeed "
            "then marks no backward as an accumulation boundary, so the owners would never "
            "receive a gradient; leave it managed (the default)"
        )
    if mode == "owner" and stage > 0 and zero.get("elastic_checkpoint", False):
        raise UnsupportedConfigError(
            "zero_optimization.elastic_checkpoint is not supported with DMuon: its checkpoints "
            "cannot be loaded back with DMuon's scalar optimizer (ZeRO asserts a 'step' entry "
            "in its param groups) and its loader bypasses the optimizer's load_state_dict; "
            "drop it (dmuon.integrations.deepspeed.save_checkpoint keeps DMuon's state apart)"
        )
    return stage, mode


_SCHEDULER_REFUSAL = (
    "{what} is not supported at ZeRO stage {stage}: DeepSpeed's LR scheduler sees the "
    "optimizer ZeRO wraps, whose param groups are the scalar ones only, so DMuon's matrix "
    "groups would keep their first lr. Schedule both yourself: a torch scheduler on "
    "dmuon_of(engine) (the matrix groups) and one on optimizer.optimizer, the torch "
    "optimizer inside the ZeRO wrapper initialize returns (the scalar groups; torch's "
    "schedulers refuse the wrapper itself), stepped after engine.step() at each "
    "accumulation boundary; or use stage 0, where DeepSpeed's scheduler reaches every group "
    "(with one lr for all of them unless its section gives one per group)"
)


# DeepSpeed's built-in schedulers that set each group's lr to a value of their section (one
# number: the same for every group; a list: one per group), by the keys they read
_GROUP_LR_KEYS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
    "LRRangeTest": ("lr_range_test_min_lr",),
}


def _group_lrs(groups: list[dict[str, Any]], dmuon_options: Mapping[str, Any]) -> list[float]:
    """Each param group's lr as DMuon resolves it (a group's own, else ``lr`` for a matrix
    group and ``adamw_lr`` or ``lr`` for a scalar one), before DMuon is built."""
    defaults = _dmuon_defaults(dmuon_options)
    groups = _renamed_rule_keys(groups)
    matrices = _matrix_ids(groups, defaults)
    return [
        float(
            g.get("lr", defaults["lr"] if id(g["params"][0]) in matrices else _scalar_lr(defaults))
        )
        for g in groups
    ]


def _check_scheduler_lrs(cfg: Mapping[str, Any], lrs: Sequence[float]) -> None:
    """Refuse a ``"scheduler"`` section that would give every param group one lr when
    DMuon's groups have several (``adamw_lr`` apart from ``lr``): DeepSpeed's
    ``WarmupLR``, ``WarmupDecayLR``, ``OneCycle`` and ``LRRangeTest`` broadcast a number to
    every group (a nonzero one, or a maximum left at its default), which would train the
    scalar groups at the matrices' lr, silently."""
    section = cfg.get("scheduler") or {}
    keys = _GROUP_LR_KEYS.get(str(section.get("type")), ())
    if not keys or len(set(lrs)) < 2:
        return
    params = section.get("params") or {}
    one = [
        k
        for k in keys
        if (k not in params and "max" in k)
        or (k in params and not isinstance(params[k], (list, tuple)) and params[k] != 0)
    ]
    if one:
        raise UnsupportedConfigError(
            f"scheduler {section.get('type')!r} would set every param group's lr to the same "
            f"{' and '.join(one)} (one number, or its default), but DMuon's groups have the "
            f"lrs {lrs} (lr and adamw_lr): give {', '.join(one)} as a list with one value per "
            "group, in that order, or use WarmupCosineLR (its ratios scale each group's own lr)"
        )


def _clipping(cfg: Mapping[str, Any], absent: float | None = None) -> float:
    """The config's ``gradient_clipping``; when the key is absent, ``absent``, or
    DeepSpeed's own default (``GRADIENT_CLIPPING_DEFAULT``: 1.0), which it then applies."""
    if "gradient_clipping" not in cfg and absent is not None:
        return absent
    if "gradient_clipping" in cfg:
        value = cfg["gradient_clipping"]
    else:
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

        value = GRADIENT_CLIPPING_DEFAULT
    try:
        return float(value or 0.0)
    except (TypeError, ValueError):
        raise UnsupportedConfigError(
            f"gradient_clipping must be a number, got {value!r} (an 'auto' of a Hugging Face "
            "template is resolved by its Trainer; resolve it before calling initialize)"
        ) from None


def initialize(
    model: nn.Module,
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    mode: str | None = None,
    groups: Sequence[Mapping[str, Any]] | None = None,
    dedicate_options: Mapping[str, Any] | None = None,
    initialize_options: Mapping[str, Any] | None = None,
    **dmuon_options: Any,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with DMuon as the client optimizer.

    Call it on every rank instead of ``deepspeed.initialize(model=..., optimizer=...,
    config=...)``. It checks the config (:func:`check_config`), initialises
    torch.distributed through ``deepspeed.init_distributed`` if needed, and builds:

    * stage 0, ``mode="replicated"`` (the default): ``DMuon(groups, mode="replicated")``,
      handed to DeepSpeed as is (DeepSpeed averages the gradients; each matrix's owner
      orthogonalises it and the new weights are all-gathered);
    * stage 0, ``mode="owner"``: the model is dedicated as by
      :func:`dmuon.integrations.ddp.dedicate` (matrices reduced to their owners, the
      other parameters all-reduced, from hooks during backward), DMuon in owner mode
      is handed to DeepSpeed, and the engine's own gradient all-reduce is switched off
      (``engine.enable_backward_allreduce = False``). ``gradient_clipping`` is done
      by DMuon (:func:`dmuon.optim.clip_grad_norm_` before each step, by the norm of
      the averaged global gradient) and taken out of the config DeepSpeed receives;
    * stage 1/2: the matrix groups' parameters are dedicated to owner ranks (their
      gradients reduced to the owner from hooks, the new weights broadcast back),
      a ``DMuon`` in owner mode steps them, and DeepSpeed gets a
      :class:`ZeroClientOptimizer` holding only the scalar groups, which ZeRO
      partitions as usual. ``zero_allow_untested_optimizer`` is set in the config
      DeepSpeed receives (a copy; yours is not changed).

    Args:
        model: the model, on its device, the same on every rank.
        config: the DeepSpeed config (dict or JSON path). fp32 only.
        mode: ``"replicated"`` (stage 0) or ``"owner"`` (stages 0, 1, 2); ``None``: the
            stage's default (:data:`SUPPORTED`: the first listed).
        groups: parameter groups (default :func:`dmuon.optim.param_groups`); groups
            whose rule is a matrix rule go to DMuon, ``"scalar"``/``"adamw"``/
            ``"lion"`` groups to the scalar optimizer.
        dedicate_options: more arguments of the dedication: at stage 0 those of
            :func:`dmuon.integrations.ddp.dedicate`; at stages 1/2 the owner plan's
            (``group``, ``strategy``, ``layer_of``, ``layer_pack_mb``, ``stats`` and the
            other keywords of :func:`dmuon.comm.plan_owners`; any other key is refused
            by name).
        initialize_options: more arguments of ``deepspeed.initialize``
            (``training_data``, ``lr_scheduler``, ...).
        **dmuon_options: arguments of :class:`~dmuon.optim.DMuon` (``lr``,
            ``weight_decay``, ``rule``, ``adamw_lr``, ...).

    Returns:
        What ``deepspeed.initialize`` returns: ``(engine, optimizer, dataloader,
        lr_scheduler)``. :func:`dmuon_of` finds the ``DMuon`` behind the engine.

    Raises:
        UnsupportedConfigError: a config DMuon cannot serve (on every rank, before any
            collective).
        ValueError: bad DMuon options, ``mode=``/``distributed=`` among them.

    Examples:
        >>> import torch
        >>> from dmuon.integrations.deepspeed import initialize
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        >>> config = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
        >>> engine, optimizer, _, _ = initialize(model, config, lr=0.02)  # doctest: +SKIP
    """
    stage, mode = check_config(config, mode)
    if mode == "owner" and stage > 0 and (initialize_options or {}).get("lr_scheduler"):
        raise UnsupportedConfigError(  # before any collective, like check_config's
            _SCHEDULER_REFUSAL.format(stage=stage, what="initialize_options['lr_scheduler']")
        )
    for key in ("mode", "distributed", "process_group"):
        if key in dmuon_options:
            raise ValueError(
                f"{key}= is chosen by dmuon.integrations.deepspeed.initialize; use its mode= "
                f"({', '.join(sorted({m for ms in SUPPORTED.values() for m in ms}))})"
            )
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            "dmuon.integrations.deepspeed needs DeepSpeed: pip install "
            "'dmuon-integrations[deepspeed]' (or 'dmuon-optim[deepspeed]')"
        ) from e

    if not dist.is_initialized():
        deepspeed.init_distributed()
    cfg = _load(config)
    chosen: list[dict[str, Any]] = [
        {**g, "params": list(g["params"])}
        for g in (param_groups(model) if groups is None else groups)
    ]
    chosen = [g for g in chosen if g["params"]]  # DeepSpeed drops empty groups in place
    if stage == 0:  # before any collective (at stage 1/2 owner mode refuses a scheduler)
        _check_scheduler_lrs(cfg, _group_lrs(chosen, dmuon_options))
    if mode == "replicated":
        client: Any = DMuon(chosen, mode="replicated", **dmuon_options)
        return deepspeed.initialize(
            model=model, optimizer=client, config=cfg, **dict(initialize_options or {})
        )
    ded = _dedicate(model, chosen, stage, dmuon_options, dict(dedicate_options or {}))
    try:
        return _owner_initialize(
            deepspeed, model, chosen, ded, stage, cfg, dmuon_options, initialize_options
        )
    except Exception:
        # a refused option, or DeepSpeed's own refusal: the model is left as it came, so
        # the corrected call can dedicate it again
        ded.undedicate()
        raise


def _owner_initialize(
    deepspeed: Any,
    model: nn.Module,
    chosen: list[dict[str, Any]],
    ded: Dedication,
    stage: int,
    cfg: dict[str, Any],
    dmuon_options: dict[str, Any],
    initialize_options: Mapping[str, Any] | None,
) -> Any:
    """Owner mode after the dedication: the client optimizer, ``deepspeed.initialize``."""
    if stage == 0:
        client: Any = DMuon(_renamed_rule_keys(chosen), distributed=ded, **dmuon_options)
        max_norm = _clipping(cfg)
        if max_norm > 0.0:
            # DeepSpeed would clip the local gradients before the owners hold the reduced
            # ones; DMuon's clip_grad_norm_ counts each gradient where it lives.
            cfg["gradient_clipping"] = 0.0

            def clip(opt: DMuon, _args: Any, _kwargs: Any) -> None:
                clip_grad_norm_(opt, max_norm)

            client.register_step_pre_hook(clip)
    else:
        cfg["zero_allow_untested_optimizer"] = True
        # ZeRO-1/2 would clip the scalars by their own norm at DeepSpeed's default (1.0)
        # when the key is absent; an explicit value was refused by check_config
        cfg["gradient_clipping"] = 0.0
        client = _owner_client(chosen, ded, dmuon_options)
    out = deepspeed.initialize(
        model=model, optimizer=client, config=cfg, **dict(initialize_options or {})
    )
    engine = out[0]
    if stage == 0:
        # The dedication's hooks reduce the matrices to their owners and all-reduce the
        # rest, like DDP; DeepSpeed's own all-reduce of every gradient (the switch its
        # pipeline engine turns off too) would only repeat that traffic.
        engine.enable_backward_allreduce = False
    _follow_accumulation_boundary(engine, client)
    return out


def _follow_accumulation_boundary(engine: Any, client: Any) -> None:
    """Owner mode: reduce to the owners only in the last micro-batch's backward.

    DeepSpeed scales each micro-batch's loss by 1/gradient_accumulation_steps and steps
    the optimizer at the boundary; before it, the owners' reductions must not run: the
    gradients accumulate locally and the boundary's backward reduces their sum. The
    exchange asks, as each gradient arrives, ``engine.is_gradient_accumulation_boundary()``
    (so ``engine.set_gradient_accumulation_boundary`` called before ``backward``, as
    Accelerate does, is honoured) and whether DeepSpeed's ``engine.no_sync()`` is open.
    """
    dmuon = client.dmuon if isinstance(client, ZeroClientOptimizer) else client

    def at_boundary() -> bool:
        return engine.is_gradient_accumulation_boundary() and not engine.inside_no_sync_ctxt

    exchange = getattr(dmuon.engine, "exchange", None)  # owner mode: the OwnerExchange
    if exchange is None:
        raise RuntimeError(f"DMuon in mode {dmuon.mode!r} has no owner exchange to follow")
    exchange.reduction.set_sync_condition(at_boundary)


def _renamed_rule_keys(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``groups`` with a deprecated ``"algorithm"`` key moved to ``"rule"``."""
    return [renamed_rule_key(dict(g), f"param group {i}") for i, g in enumerate(groups)]


def _matrix_ids(groups: list[dict[str, Any]], defaults: Mapping[str, Any]) -> set[int]:
    """ids of the parameters of the groups whose rule is a matrix rule."""
    ids = set()
    for g in groups:
        algorithm = g.get("rule", defaults["rule"])
        if algorithm in RULES:
            ids |= {id(p) for p in g["params"]}
        elif algorithm not in (*SCALAR_ALGORITHMS, "scalar"):
            raise ValueError(
                f"param group {g.get('name', '?')!r}: unknown rule {algorithm!r}; expected "
                f"one of {sorted(RULES) + list(SCALAR_ALGORITHMS) + ['scalar']}"
            )
    return ids


def _dedicate(
    model: nn.Module,
    groups: list[dict[str, Any]],
    stage: int,
    dmuon_options: dict[str, Any],
    dedicate_options: dict[str, Any],
) -> Dedication:
    """The matrix groups' parameters dedicated to owners: stage 0 as by
    :func:`dmuon.integrations.ddp.dedicate` (the other parameters all-reduced), stages
    1/2 alone (ZeRO partitions the rest)."""
    matrices = _matrix_ids(_renamed_rule_keys(groups), _dmuon_defaults(dmuon_options))

    def predicate(_name: str, p: torch.Tensor) -> bool:
        return id(p) in matrices

    if stage == 0:
        return ddp.dedicate(model, predicate=predicate, **dedicate_options)
    taken = {"group", "strategy", "layer_of", "layer_pack_mb", "stats"}
    planned = set(inspect.signature(plan_owners).parameters) - {
        "items",
        "world_size",
        "replicate_size",
        "held",
    }
    unknown = sorted(set(dedicate_options) - taken - planned)
    if unknown:
        raise ValueError(
            f"dedicate_options {unknown} are not taken at ZeRO stage {stage}, where ZeRO "
            "holds the scalar parameters and DMuon dedicates the matrices alone; accepted: "
            f"{sorted(taken | planned)} (the owner plan's options)"
        )
    return build_dedication(
        model,
        dedicate_options.pop("group", None),
        predicate=predicate,
        strategy=dedicate_options.pop("strategy", "lpt"),
        layer_of=dedicate_options.pop("layer_of", layer_key),
        layer_pack_mb=dedicate_options.pop("layer_pack_mb", DEFAULT_PACK_MB),
        stats=dedicate_options.pop("stats", None),
        all_reduce_rest=False,
        kind="deepspeed",
        plan_options=dedicate_options,
    )


def _owner_client(
    groups: list[dict[str, Any]], ded: Dedication, dmuon_options: dict[str, Any]
) -> ZeroClientOptimizer:
    """Stages 1/2: DMuon in owner mode on the matrix groups, the rest for ZeRO."""
    defaults = _dmuon_defaults(dmuon_options)
    groups = _renamed_rule_keys(groups)
    matrices = _matrix_ids(groups, defaults)
    matrix_groups, scalar_groups = [], []
    for g in groups:  # (no empty groups here)
        if id(g["params"][0]) in matrices:
            matrix_groups.append(g)
        else:
            algorithm = g.get("rule", defaults["rule"])
            if algorithm == "scalar":
                algorithm = defaults["scalar_optimizer"]
            scalar_groups.append(_scalar_group(g, algorithm, defaults))
    dmuon = DMuon(matrix_groups, distributed=ded, **dmuon_options)
    return ZeroClientOptimizer(scalar_groups, dmuon)


def _dmuon_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """DMuon's constructor arguments: ``options`` over the signature's defaults."""
    sig = inspect.signature(DMuon.__init__).parameters
    out = {k: p.default for k, p in sig.items() if p.default is not inspect.Parameter.empty}
    out.update(options)
    return out


def _scalar_lr(defaults: Mapping[str, Any]) -> Any:
    """A scalar group's lr when it names none, as DMuon resolves it: ``adamw_lr``, else
    ``lr``."""
    return defaults["lr"] if defaults["adamw_lr"] is None else defaults["adamw_lr"]


def _scalar_group(
    group: Mapping[str, Any], algorithm: str, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    # The same resolution as DMuon's: a group's own value, else adamw_* (lr: _scalar_lr),
    # for each key the scalar rule reads (its ScalarRule's options: a rule of its own
    # that reads eps gets adamw_eps; Lion, which does not, loses an eps given to it)
    constructor = {
        "lr": _scalar_lr(defaults),
        "betas": defaults["adamw_betas"],
        "eps": defaults["adamw_eps"],
        "weight_decay": defaults["adamw_weight_decay"],
        "cautious_weight_decay": defaults["cautious_weight_decay"],
    }
    out = dict(group)
    out["rule"] = algorithm
    reads = get_scalar_rule(algorithm).options
    for key, value in constructor.items():
        if key in reads:
            out.setdefault(key, value)
        else:
            out.pop(key, None)
    return out
