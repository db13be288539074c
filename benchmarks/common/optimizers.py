"""Optimizer factories by name, with one set of conventions for every optimizer.

Names:

* ``"adamw"`` — ``torch.optim.AdamW`` (foreach) on every parameter.
* ``"torch_muon"`` — ``torch.optim.Muon`` on the hidden matrices (it accepts 2-D
  parameters only) with ``adjust_lr_fn="match_rms_adamw"``, plus ``torch.optim.AdamW``
  on everything else: the fair baseline for DMuon.
* ``"dmuon:<rule>"`` — ``dmuon.optim.DMuon(param_groups(model), lr=..., rule=<rule>)``
  (``dmuon:muon``, ``dmuon:normuon``, ``dmuon:dion3``, ``dmuon:sign_muon``, …), the API
  of dmuon-optim.

Conventions shared by all of them, so that a comparison differs only in how the
hidden matrices are updated:

* The hidden matrices are the 2-D weights inside the transformer blocks
  (:func:`benchmarks.common.model.hidden_matrix_names`); the embeddings, the output
  head, norms and biases ("scalar" parameters) are trained by AdamW with
  ``betas``/``eps`` and learning rate ``scalar_lr`` (for ``"adamw"`` it defaults to
  ``lr``, so plain AdamW uses one learning rate).
* Decoupled weight decay ``W ← W(1 − lr·wd)`` with the *base* learning rate, on the
  hidden matrices only (none on embeddings, head, norms, biases).
* The Muon-family learning rates follow the RMS-matching convention of Moonlight
  (Liu et al. 2025, eq. 4: update scale ``0.2·√max(m, n)``), so their learning rates
  and weight decay live on AdamW's scale.
* One schedule for all: linear warm-up then cosine or linear decay
  (:func:`lr_multiplier`), applied to every group through ``LambdaLR``.

Example:
    >>> from benchmarks.common.model import GPT, GPTConfig
    >>> from benchmarks.common.optimizers import build_optimizer
    >>> model = GPT(GPTConfig.tiny())
    >>> opt = build_optimizer("torch_muon", model, lr=2e-3, scalar_lr=3e-3)
    >>> [type(o).__name__ for o in opt.optimizers]
    ['Muon', 'AdamW']
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "DEFAULT_OPTIMIZERS",
    "DMuonUnavailableError",
    "Optimizers",
    "build_optimizer",
    "is_hidden_matrix",
    "lr_multiplier",
    "parse_optimizer_name",
    "require_dmuon",
]

DEFAULT_OPTIMIZERS = (
    "dmuon:muon",
    "dmuon:normuon",
    "dmuon:dion3",
    "dmuon:sign_muon",
    "adamw",
    "torch_muon",
)
SCALAR_ALGORITHMS = ("adamw", "lion")


class DMuonUnavailableError(ImportError):
    """``dmuon.optim`` or one of the names the ``dmuon:*`` optimizers need is missing."""


def parse_optimizer_name(name: str) -> tuple[str, str | None]:
    """``"adamw"`` → ``("adamw", None)``; ``"dmuon:normuon"`` → ``("dmuon", "normuon")``.

    Raises:
        ValueError: anything but ``adamw``, ``torch_muon`` or ``dmuon:<rule>``.
    """
    if name in ("adamw", "torch_muon"):
        return name, None
    if name.startswith("dmuon:") and len(name) > len("dmuon:"):
        return "dmuon", name.split(":", 1)[1]
    raise ValueError(
        f"unknown optimizer {name!r}; use 'adamw', 'torch_muon' or 'dmuon:<rule>' "
        f"(e.g. 'dmuon:muon', 'dmuon:normuon', 'dmuon:dion3', 'dmuon:sign_muon')"
    )


def require_dmuon() -> tuple[Any, Any]:
    """Return ``(DMuon, param_groups)`` from ``dmuon.optim``.

    Raises:
        DMuonUnavailableError: naming what is missing — the ``dmuon.optim`` module
            (dmuon-optim not installed) or the ``DMuon`` / ``param_groups`` names in it.
    """
    try:
        module = importlib.import_module("dmuon.optim")
    except ImportError as exc:
        raise DMuonUnavailableError(
            f"the 'dmuon:<rule>' optimizers need the dmuon.optim module, which could not "
            f"be imported ({exc}); install dmuon-optim, e.g. "
            f"`pip install -c constraints.txt -e packages/dmuon-kernels -e packages/dmuon-comm "
            f"-e packages/dmuon-optim`"
        ) from exc
    missing = [n for n in ("DMuon", "param_groups") if not hasattr(module, n)]
    if missing:
        where = getattr(module, "__file__", None) or list(getattr(module, "__path__", []))
        raise DMuonUnavailableError(
            f"dmuon.optim (imported from {where}) has no {' and no '.join(missing)}; the "
            f"'dmuon:<rule>' optimizers need `from dmuon.optim import DMuon, param_groups` "
            f"(the dmuon-optim API of issue 5). Run the other optimizers with --optimizers "
            f"adamw,torch_muon, or install a dmuon-optim that provides them."
        )
    return module.DMuon, module.param_groups


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """The default split: a 2-D parameter inside ``model.blocks``."""
    return name.startswith("blocks.") and p.dim() == 2


def lr_multiplier(
    step: int,
    total_steps: int,
    warmup_steps: int,
    decay: str = "cosine",
    final_fraction: float = 0.0,
) -> float:
    """The learning-rate factor used by update ``step`` (0-based).

    Linear warm-up ``(step + 1)/warmup_steps`` for ``step < warmup_steps``, then with
    ``p = (step − warmup_steps)/(total_steps − warmup_steps)``::

        cosine: f + (1 − f)·½(1 + cos πp)        linear: 1 − (1 − f)·p

    where ``f = final_fraction``. Steps past the end keep the final value.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps`` outside ``[0, total_steps)``,
            ``final_fraction`` outside [0, 1] or an unknown ``decay``.

    Examples:
        >>> from benchmarks.common.optimizers import lr_multiplier
        >>> [round(lr_multiplier(s, 10, 2), 3) for s in (0, 1, 2, 6, 9)]
        [0.5, 1.0, 1.0, 0.345, 0.03]
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps must be in [0, {total_steps}), got {warmup_steps}")
    if not 0.0 <= final_fraction <= 1.0:
        raise ValueError(f"final_fraction must be in [0, 1], got {final_fraction}")
    if decay not in ("cosine", "linear"):
        raise ValueError(f"decay must be 'cosine' or 'linear', got {decay!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "cosine":
        return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * p))
    return 1 - (1 - final_fraction) * p


@dataclasses.dataclass
class Optimizers:
    """One or more torch optimizers over disjoint parameters, stepped together.

    Attributes:
        name: the factory name (``"torch_muon"``, ``"dmuon:normuon"``, …).
        optimizers: the ``torch.optim.Optimizer`` objects.
        matrix_names: parameters updated by a Muon-family rule (empty for AdamW).
        notes: anything a result file should record (e.g. a grouping that differs
            from the shared convention).
    """

    name: str
    optimizers: list[torch.optim.Optimizer]
    matrix_names: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)
    schedulers: list[torch.optim.lr_scheduler.LambdaLR] = dataclasses.field(default_factory=list)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        for sched in self.schedulers:
            sched.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def attach_schedule(self, lr_lambda: Callable[[int], float]) -> None:
        """Scale every group's initial lr by ``lr_lambda(step)`` (``LambdaLR``)."""
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) for opt in self.optimizers
        ]

    def lrs(self) -> list[float]:
        return [float(g["lr"]) for opt in self.optimizers for g in opt.param_groups]


def _split(
    model: nn.Module, is_matrix: Callable[[str, nn.Parameter], bool]
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    matrices: list[tuple[str, nn.Parameter]] = []
    scalars: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():  # tied parameters are listed once
        if not p.requires_grad:
            continue
        (matrices if is_matrix(name, p) else scalars).append((name, p))
    return matrices, scalars


def build_optimizer(
    name: str,
    model: nn.Module,
    *,
    lr: float,
    scalar_lr: float | None = None,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    momentum: float = 0.95,
    is_matrix: Callable[[str, nn.Parameter], bool] = is_hidden_matrix,
    rule_options: dict[str, Any] | None = None,
) -> Optimizers:
    """Build optimizer ``name`` for ``model`` under the module's shared conventions.

    Args:
        name: ``"adamw"``, ``"torch_muon"`` or ``"dmuon:<rule>"``.
        model: the model (its parameters are grouped with ``is_matrix``).
        lr: the learning rate of the hidden matrices (of everything for AdamW).
        scalar_lr: AdamW learning rate of the scalar parameters; default ``lr`` for
            ``"adamw"``, and required for the others.
        weight_decay: decoupled weight decay on the hidden matrices.
        betas, eps: AdamW's, for AdamW and for the scalar parameters of the others.
        momentum: Muon-family momentum.
        is_matrix: the hidden-matrix predicate ``(name, parameter) → bool``.
        rule_options: extra keyword arguments passed to ``DMuon`` (rule options).

    Raises:
        ValueError: an unknown name, ``lr``/``scalar_lr`` not positive, or a missing
            ``scalar_lr`` for a Muon-family optimizer.
        DMuonUnavailableError: ``dmuon:*`` without ``dmuon.optim.DMuon`` /
            ``param_groups``.
    """
    kind, rule = parse_optimizer_name(name)
    if kind == "adamw" and scalar_lr is None:
        scalar_lr = lr
    if scalar_lr is None:
        raise ValueError(f"{name} needs scalar_lr (the AdamW lr of embeddings, head, norms)")
    for label, value in (("lr", lr), ("scalar_lr", scalar_lr)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{label} must be a positive finite float, got {value!r}")
    matrices, scalars = _split(model, is_matrix)
    matrix_names = [n for n, _ in matrices]

    def scalar_adamw(params: Sequence[nn.Parameter]) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            params, lr=scalar_lr, betas=betas, eps=eps, weight_decay=0.0, foreach=True
        )

    if kind == "adamw":
        groups = [
            {"params": [p for _, p in matrices], "weight_decay": weight_decay, "lr": lr},
            {"params": [p for _, p in scalars], "weight_decay": 0.0, "lr": scalar_lr},
        ]
        opt = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, foreach=True
        )
        return Optimizers(name, [opt], [])

    if kind == "torch_muon":
        if not matrices:
            raise ValueError("torch_muon: the model has no hidden matrix (is_matrix matched none)")
        muon = torch.optim.Muon(
            [p for _, p in matrices],
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        )
        opts: list[torch.optim.Optimizer] = [muon]
        if scalars:
            opts.append(scalar_adamw([p for _, p in scalars]))
        return Optimizers(name, opts, matrix_names)

    DMuon, param_groups = require_dmuon()
    opt = DMuon(
        param_groups(model),
        lr=lr,
        rule=rule,
        momentum=momentum,
        weight_decay=weight_decay,
        adamw_lr=scalar_lr,
        adamw_betas=betas,
        adamw_eps=eps,
        adamw_weight_decay=0.0,
        **(rule_options or {}),
    )
    result = Optimizers(name, [opt], matrix_names)
    result.notes.extend(grouping_differences(opt, model, matrix_names))
    return result


def grouping_differences(
    optimizer: torch.optim.Optimizer, model: nn.Module, matrix_names: Sequence[str]
) -> list[str]:
    """Where an optimizer's ``"rule"`` groups disagree with the shared split.

    A group whose ``"rule"`` is not ``"adamw"``/``"lion"`` is a matrix-rule group.
    Returns one readable line per disagreement (empty when they agree).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    by_rule: set[str] = set()
    for group in optimizer.param_groups:
        if group.get("rule", "adamw") not in SCALAR_ALGORITHMS:
            by_rule.update(names.get(id(p), "<not in model>") for p in group["params"])
    expected = set(matrix_names)
    notes = []
    if extra := sorted(by_rule - expected):
        notes.append(f"matrix rule also got (shared convention: AdamW): {extra}")
    if missing := sorted(expected - by_rule):
        notes.append(f"matrix rule did not get (shared convention: matrix rule): {missing}")
    return notes
