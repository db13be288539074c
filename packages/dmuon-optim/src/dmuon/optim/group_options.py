"""Parameter groups of :class:`~dmuon.optim.DMuon`: their defaults, normalisation and checks.

A group names its ``"rule"`` (a matrix rule of :data:`~dmuon.optim.RULES` or a
scalar optimizer of :data:`~dmuon.optim.SCALAR_ALGORITHMS`); every key it leaves
out is filled from the constructor's arguments — for a rule option, the value the
caller passed to ``DMuon(**rule_options)`` if any, else the rule's own default (a
rule's default never overrides a caller's value). Every value is checked by its
:class:`~dmuon.optim.hyperparameters.Option`, every parameter against what the
rule can take, each error naming the group, the key or the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dmuon.optim.engine.exchange import exchange_of
from dmuon.optim.hyperparameters import FLOAT32_MAX, MATRIX_KEYS, SCALAR_OPTIONS
from dmuon.optim.layout import matrix_layout
from dmuon.optim.option_names import (
    accepted_options,
    refuse_unknown_keys,
    refuse_unused_options,
    renamed_rule_key,
)
from dmuon.optim.rules import RULES, get_rule
from dmuon.optim.scalar import SCALAR_ALGORITHMS

__all__ = [
    "STRUCTURE",
    "GroupDefaults",
    "accepted_options",
    "check_distinct_params",
    "check_together",
    "check_value",
    "param_name",
    "refuse_unknown_keys",
    "renamed_rule_key",
    "structure_of",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The structural keys a group's buckets depend on; changing them after construction
# would silently mismatch the state, so step() refuses.
STRUCTURE = ("rule", "flatten", "transposed", "split_sizes", "num_heads", "state_dtype")


@dataclass
class GroupDefaults:
    """What a group that leaves keys out gets: the constructor's arguments, checked.

    Attributes:
        rule: the matrix rule of groups that name no ``"rule"``.
        scalar_optimizer: what ``rule="scalar"`` means (``"adamw"``/``"lion"``).
        matrix: defaults of the keys every matrix rule takes (:data:`MATRIX_KEYS`).
        scalar: defaults of the scalar optimizers' keys (lr, betas, eps, weight_decay).
        rule_options: the caller's rule options (``DMuon(**rule_options)``).
    """

    rule: str
    scalar_optimizer: str
    matrix: dict[str, Any]
    scalar: dict[str, Any]
    rule_options: dict[str, Any]

    @staticmethod
    def check_rule(rule: str) -> None:
        """Raise unless ``rule`` names a matrix rule (the error lists them)."""
        get_rule(rule)

    @classmethod
    def build(
        cls,
        rule: str,
        scalar_optimizer: str,
        matrix: Mapping[str, Any],
        scalar: Mapping[str, Any],
        rule_options: Mapping[str, Any],
    ) -> GroupDefaults:
        """Check the constructor's values (``scalar`` keys named ``adamw_*`` in errors)."""
        get_rule(rule)
        if scalar_optimizer not in SCALAR_ALGORITHMS:
            raise ValueError(
                f"scalar_optimizer must be one of {list(SCALAR_ALGORITHMS)}, "
                f"got {scalar_optimizer!r}"
            )
        checked = {k: check_value(k, v, MATRIX_KEYS[k], "DMuon") for k, v in matrix.items()}
        scalars = {
            k: check_value(f"adamw_{k}", v, SCALAR_OPTIONS[k], "DMuon") for k, v in scalar.items()
        }
        options = dict(rule_options)
        default_rule = get_rule(rule).options
        for key, value in options.items():
            if key in MATRIX_KEYS:
                checked[key] = check_value(key, value, MATRIX_KEYS[key], "DMuon")
            elif key in default_rule:
                # checked now even if no group takes the default rule: ``opt.defaults``
                # shows it, and a group added later would be refused only then
                check_value(key, value, default_rule[key], "DMuon")
        return cls(rule, scalar_optimizer, checked, scalars, options)

    def to_config(self) -> dict[str, Any]:
        """Plain values for a pickle (``DMuon.__getstate__``)."""
        return {
            "rule": self.rule,
            "scalar_optimizer": self.scalar_optimizer,
            "matrix_defaults": self.matrix,
            "scalar_defaults": self.scalar,
            "rule_options": self.rule_options,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GroupDefaults:
        """The defaults :meth:`to_config` saved (a key added since, e.g.
        ``cautious_weight_decay`` or ``transposed``, takes its constructor default)."""
        matrix = {"cautious_weight_decay": False, "transposed": False, **config["matrix_defaults"]}
        scalar = {"cautious_weight_decay": False, **config["scalar_defaults"]}
        return cls(
            config["rule"], config["scalar_optimizer"], matrix, scalar, config["rule_options"]
        )

    def torch_defaults(self) -> dict[str, Any]:
        """The ``defaults`` handed to ``torch.optim.Optimizer`` (the default rule's keys)."""
        defaults = {"rule": self.rule, **self.matrix}
        for key, opt in get_rule(self.rule).options.items():
            defaults[key] = self.rule_options.get(key, opt.default)
        return defaults

    def check_options_used(
        self, groups: list[dict[str, Any]], keywords: Collection[str] = ()
    ) -> None:
        """Raise if a caller's rule option is taken by no rule of the groups (``keywords``:
        the constructor's own, offered for a misspelt one)."""
        refuse_unused_options(self.rule, self.rule_options, groups, keywords)

    def normalize(self, param_group: Mapping[str, Any], index: int) -> dict[str, Any]:
        """Group ``index`` with every key filled in and checked, its parameters listed."""
        group = dict(param_group)
        params = group.get("params")
        if params is None:
            raise ValueError(f"param group {index} has no 'params'")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("parameters must be an ordered collection (a list), not a set")
        params = list(params)
        where = f"param group {index}"
        if params and all(isinstance(p, tuple) for p in params):
            if any(len(p) != 2 for p in params):
                raise TypeError(
                    f"{where}: named parameters must be (name, parameter) pairs, as "
                    "model.named_parameters() gives them"
                )
            group["param_names"] = [n for n, _ in params]
            params = [p for _, p in params]
        group["params"] = params
        if "param_names" in group:
            group["param_names"] = checked_param_names(group["param_names"], len(params), where)
        renamed_rule_key(group, where)
        rule_name = group.get("rule", self.rule)
        if rule_name == "scalar":
            rule_name = self.scalar_optimizer
        accepted_rules = sorted(RULES) + list(SCALAR_ALGORITHMS) + ["scalar"]
        if rule_name not in RULES and rule_name not in SCALAR_ALGORITHMS:
            raise ValueError(
                f"{where}: unknown rule {rule_name!r}; expected one of {accepted_rules}"
            )
        group["rule"] = rule_name
        keys = accepted_options(rule_name)
        if rule_name in SCALAR_ALGORITHMS:
            defaults = dict(self.scalar)
        else:
            defaults = dict(self.matrix)
            for key, opt in get_rule(rule_name).options.items():
                defaults[key] = self.rule_options.get(key, opt.default)
        refuse_unknown_keys(group, where)
        for key, opt in keys.items():
            value = group[key] if key in group else defaults[key]
            group[key] = check_value(key, value, opt, where)
        check_together(group, where)
        names = group.get("param_names")
        for i, p in enumerate(params):
            check_param(p, rule_name, group, param_name(names, i, index, p))
        return group


def check_together(group: Mapping[str, Any], where: str, *, largest: int | None = None) -> None:
    """Raise if two of ``group``'s checked values contradict each other (each value alone
    passed its :class:`~dmuon.optim.hyperparameters.Option`). ``largest``: the most
    elements of one of its parameters, when the caller knows it
    (:func:`check_float32_products`).

    Raises:
        ValueError: ``state_rounding='stochastic'`` without ``state_dtype='bfloat16'``.
    """
    if group.get("state_rounding") == "stochastic" and group.get("state_dtype") != "bfloat16":
        raise ValueError(
            f"{where}: state_rounding 'stochastic' rounds fp32 state to bfloat16; it needs "
            f"state_dtype='bfloat16', got state_dtype={group.get('state_dtype')!r}"
        )
    check_float32_products(group, where, largest=largest)


def check_float32_products(
    group: Mapping[str, Any], where: str, *, largest: int | None = None
) -> None:
    """Raise if a product of ``group``'s values that the step hands torch as a float32
    scalar is past float32's largest (:data:`~dmuon.optim.hyperparameters.FLOAT32_MAX`).

    Each value alone is bounded by it (:func:`~dmuon.optim.hyperparameters.real`), but the
    step multiplies some: ``1 − lr·weight_decay`` (every rule's decay), AdamW's first step
    size ``lr/(1 − β₁)``, a matrix rule's ``lr·scale`` (the ``adjust_lr`` factor, at most
    √(m·n) for an m×n matrix, times ``block_lr_scale``/``full_lr_scale``/``radius``), and
    MONA's ``mona_gamma/(1 − momentum)``. Such a product failed in torch (``value cannot be
    converted to type float without overflow``) mid-step, after the groups before had
    stepped; refused here, at construction and by ``step()`` before anything changes.
    The bound on ``lr·scale`` is by √(m·n), the largest factor of every convention, so it
    may refuse an lr that one convention would have taken: only lr past ~1e33 is.

    ``largest``: the most elements of one of the group's parameters, when the caller
    knows it (a step re-checking a tensor ``lr``: the group's shapes are fixed), else
    read from ``group["params"]``.

    Raises:
        ValueError: naming the keys, their product and the bound.
    """

    def value(key: str) -> float | None:
        v = group.get(key)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return float(v.item())
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def refuse(what: str, product: float, fix: str) -> None:
        raise ValueError(
            f"{where}: {what} = {product:.4g} is past float32's largest ({FLOAT32_MAX:.4g}); "
            f"the step computes it in float32 and would fail half-way. {fix}"
        )

    lr, wd = value("lr"), value("weight_decay")
    if lr is None:
        return
    if wd is not None and lr * wd > FLOAT32_MAX:
        refuse("lr × weight_decay", lr * wd, "Lower lr or weight_decay")
    betas = group.get("betas")
    if group.get("rule") == "adamw" and isinstance(betas, tuple) and len(betas) == 2:
        first = lr / (1.0 - float(betas[0]))  # β₁ < 1: checked by its option
        if first > FLOAT32_MAX:
            refuse("lr / (1 − beta1), AdamW's first step size", first, "Lower lr or beta1")
    if group.get("rule") in RULES:
        factor = 1.0
        for key in ("block_lr_scale", "full_lr_scale", "radius"):
            k = value(key)
            if k is not None:
                factor *= k
        if largest is None:
            params = group.get("params") or []
            largest = max((p.numel() for p in params if isinstance(p, torch.Tensor)), default=1)
        factor *= math.sqrt(largest)
        if lr * factor > FLOAT32_MAX:
            refuse(
                "lr × the rule's largest scale (√(m·n) × its lr scales)",
                lr * factor,
                "Lower lr",
            )
    gamma, mu = value("mona_gamma"), value("momentum")
    if gamma is not None and mu is not None and gamma / (1.0 - mu) > FLOAT32_MAX:
        refuse("mona_gamma / (1 − momentum)", gamma / (1.0 - mu), "Lower mona_gamma")


def checked_param_names(names: Any, count: int, where: str) -> list[str]:
    """``names`` as a list, checked to name each of a group's ``count`` parameters.

    Errors, messages and the step's bookkeeping index a group's ``param_names`` by
    parameter position: a list of another length indexed past its end at the step
    (``IndexError`` after the first groups had stepped), a string was taken as a list of
    one-letter names, and a name that is not a string failed in the embedding check.

    Raises:
        TypeError: ``names`` is not a list or tuple of strings (a ``str`` itself included).
        ValueError: a name is empty, or there is not one name per parameter.
    """
    if not isinstance(names, (list, tuple)):
        raise TypeError(
            f"{where}: param_names must be a list of strings, one per parameter, got "
            f"{type(names).__name__} {names!r}"[:300]
        )
    for i, n in enumerate(names):
        if not isinstance(n, str):
            raise TypeError(
                f"{where}: param_names[{i}] must be a str (the parameter's name, as "
                f"model.named_parameters() gives it), got {type(n).__name__} {n!r}"[:300]
            )
        if not n:
            raise ValueError(f"{where}: param_names[{i}] is an empty string; name the parameter")
    if len(names) != count:
        raise ValueError(
            f"{where}: param_names has {len(names)} name(s) for {count} parameter(s); "
            "give one name per parameter, in the order of 'params'"
        )
    return list(names)


def check_param(p: Any, rule_name: str, group: Mapping[str, Any], name: str) -> None:
    """Raise unless ``"rule"`` can step ``p`` (a real float tensor; a rule: a matrix)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} is a {type(p).__name__}; DMuon optimizes torch.Tensors")
    if not p.is_leaf:
        raise ValueError(
            f"{name} is not a leaf tensor (it was computed from others, e.g. "
            "weight * 2 or weight.to(dtype)); an optimizer steps the tensors autograd "
            "gives gradients to: pass the model's parameters (model.parameters(), or "
            "nn.Parameter / tensor.detach().requires_grad_() for a tensor of your own)"
        )
    if p.device.type == "meta":
        # torch's module.to_empty() makes new parameters: an optimizer built before it
        # holds the meta ones, which never get a gradient, and every step moved nothing
        raise ValueError(
            f"{name} is on the meta device (no storage); build the optimizer after the "
            "model is materialised (model.to_empty(device=...) makes new parameters, so "
            "an optimizer built before it would step none of the model's)"
        )
    if p.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} has dtype {p.dtype}; DMuon optimizes real floating-point parameters "
            f"({', '.join(str(d) for d in FLOAT_DTYPES)})"
        )
    if rule_name in RULES:
        matrix_layout(p, dict(group), name)
        # a dedicated weight freed on this rank (ZeRO-3-like) is one broadcast NaN;
        # another rank owns it, this one never updates it
        freed = exchange_of(p) is not None and 0 in p.stride() and p.numel() > 1
        if not p.is_contiguous() and not freed:
            raise ValueError(
                f"{name} is not contiguous; matrix rules update "
                "parameters through views — make it contiguous (e.g. not channels_last)"
            )


def check_value(key: str, value: Any, opt: Any, where: str) -> Any:
    """``opt.check(value)``, its error prefixed with where and which key."""
    try:
        return opt.check(value)
    except ValueError as e:
        raise ValueError(f"{where}: {key} {e}") from None


def param_name(names: list[str] | None, i: int, group_index: int, p: Any) -> str:
    """How errors name parameter ``i`` of group ``group_index``."""
    shape = tuple(p.shape) if isinstance(p, torch.Tensor) else "?"
    if names is not None and i < len(names):
        return f"parameter {names[i]!r} (param group {group_index}, shape {shape})"
    return f"parameter {i} of param group {group_index} (shape {shape})"


def structure_of(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a group's buckets depend on (:data:`STRUCTURE` and its parameters)."""
    return (*(group.get(k) for k in STRUCTURE), tuple(map(id, group["params"])))


def check_distinct_params(
    group: Mapping[str, Any], index: int, groups: list[dict[str, Any]]
) -> None:
    """Raise if a parameter of ``group`` (to become group ``index``) is listed twice in it
    or already belongs to one of ``groups`` (it would be stepped twice)."""
    seen = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    mine: set[int] = set()
    for k, p in enumerate(group["params"]):
        name = param_name(group.get("param_names"), k, index, p)
        if id(p) in mine:
            raise ValueError(
                f"{name} is listed twice in param group {index}; it would be stepped twice "
                "per step. List each parameter once (param_groups(model) does)"
            )
        mine.add(id(p))
        if id(p) in seen:
            raise ValueError(
                f"{name} appears in more than one parameter group (it is already in "
                f"param group {seen[id(p)]}); param_groups(model) assigns each parameter once"
            )
