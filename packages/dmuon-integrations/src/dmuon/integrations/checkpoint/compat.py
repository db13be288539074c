"""Checking a checkpoint against the model and optimizer, and handing its state over.

Both formats (DCP and the single-file full state dict) name the same things:
``model.<fqn>`` tensors, ``optim.state.<fqn>.<key>`` tensors and
``optim.param_groups`` (hyperparameters with ``params`` as lists of FQNs, the
convention of ``torch.distributed.checkpoint.state_dict``). Before anything is
changed, :func:`check_compatible` compares what the checkpoint holds with what the
model and optimizer expect and raises one error naming the missing keys, the
shapes that differ, the group whose rule differs and the group hyperparameters that
do not check (an unknown key, a value out of range). :func:`load_into_optimizer`
then gives the values to ``DMuon.load_state_dict``, which validates again and
rebuilds the stacked state buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dmuon.integrations.checkpoint.holders import Holding
from dmuon.integrations.checkpoint.split_state import as_loaded
from dmuon.optim import DMuon
from dmuon.optim.batch_layout import state_shapes
from dmuon.optim.group_options import STRUCTURE
from dmuon.optim.layout import matrix_layout
from dmuon.optim.rules import RULES, get_rule
from dmuon.optim.scalar import scalar_state_shapes

__all__ = [
    "CheckpointMismatchError",
    "check_compatible",
    "expected_state_shapes",
    "load_into_optimizer",
    "saved_groups",
]

# The group keys a matrix state's layout follows besides the rule: they must match too
# (the state's shapes, the tensors read into, follow the optimizer's).
_LAYOUT = tuple(k for k in STRUCTURE if k not in ("rule", "state_dtype"))


def _plain(value: Any) -> Any:
    """Tuples as lists, as a checkpoint's param groups hold them."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# Keys of a param group that describe its parameters, not its hyperparameters.
_NOT_HYPER = ("params", "param_names")


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into.

    Raised on every rank before anything is changed. The message lists each
    problem: a missing key, a shape that differs, a group whose rule
    or parameters differ, a group hyperparameter that does not check.

    Attributes:
        problems: one line per problem.

    Examples:
        >>> err = CheckpointMismatchError(["missing key 'model.w'"])
        >>> err.problems
        ["missing key 'model.w'"]
    """

    def __init__(self, problems: Sequence[str]) -> None:
        shown = list(problems[:12]) + (
            [f"… and {len(problems) - 12} more"] if len(problems) > 12 else []
        )
        super().__init__(
            "the checkpoint does not fit this model/optimizer:\n"
            + "\n".join(f"  {p}" for p in shown)
        )
        self.problems = list(problems)


class CheckpointReadError(RuntimeError):
    """A checkpoint's files could not be read (a data file truncated, corrupt or missing).

    ``torch.distributed.checkpoint`` reports this as its ``CheckpointException``, a
    ``BaseException`` that an ``except Exception`` fallback does not catch; this wraps it
    (``__cause__``). Raised on every rank, with the model and optimizer unchanged.

    Attributes:
        path: the checkpoint directory.
        ranks: the ranks whose reads failed.

    Examples:
        >>> err = CheckpointReadError("ckpt/step-100", [1], "EOFError: ...")
        >>> err.ranks
        [1]
    """

    def __init__(self, path: str, ranks: Sequence[int], detail: str) -> None:
        super().__init__(
            f"could not read checkpoint {path!r} (rank(s) {list(ranks)} failed; nothing was "
            f"changed): {detail}. Load an earlier checkpoint"
        )
        self.path = path
        self.ranks = list(ranks)


def expected_state_shapes(h: Holding, group: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The whole (global) shape of each optimizer state tensor of ``h``'s parameter."""
    algorithm = group["rule"]
    if algorithm in RULES:
        layout = matrix_layout(h.param, dict(group), h.fqn)
        return state_shapes(get_rule(algorithm), layout)
    return scalar_state_shapes(algorithm, h.param)


def saved_groups(optim_sd: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``param_groups`` of an FQN-keyed optimizer state dict, checked for form."""
    groups = optim_sd.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointMismatchError(["optimizer state has no 'param_groups' list"])
    return [dict(g) for g in groups]


def check_compatible(
    holdings: Sequence[Holding],
    optimizer: DMuon,
    model_shapes: Mapping[str, tuple[int, ...]],
    saved_shapes: Mapping[str, tuple[int, ...] | None],
    groups: Sequence[Mapping[str, Any]],
) -> None:
    """Raise :class:`CheckpointMismatchError` unless the checkpoint fits.

    Args:
        holdings: the optimizer's parameters (:func:`~.holders.holdings`).
        optimizer: the optimizer.
        model_shapes: ``fqn → shape`` of every model tensor to load.
        saved_shapes: flat key (``model.<fqn>``, ``optim.state.<fqn>.<key>``) → shape
            of what the checkpoint holds (``None``: not a tensor).
        groups: the checkpoint's param groups (``params``: lists of FQNs).
    """
    problems: list[str] = []

    def check(key: str, shape: tuple[int, ...]) -> None:
        if key not in saved_shapes:
            problems.append(f"missing key {key!r} (expected a tensor of shape {shape})")
            return
        got = saved_shapes[key]
        if got is None:
            problems.append(f"key {key!r} is not a tensor in the checkpoint; expected {shape}")
        elif tuple(got) != tuple(shape):
            problems.append(
                f"shape mismatch for {key!r}: checkpoint {tuple(got)}, expected {shape}"
            )

    for fqn, shape in model_shapes.items():
        check(f"model.{fqn}", tuple(shape))
    current = optimizer.param_groups
    if len(groups) != len(current):
        problems.append(
            f"the checkpoint has {len(groups)} param group(s), the optimizer {len(current)}"
        )
    else:
        by_group: dict[int, list[str]] = {}
        for h in holdings:
            by_group.setdefault(h.group_index, []).append(h.fqn)
        for gi, (saved, live) in enumerate(zip(groups, current, strict=True)):
            if saved.get("rule") != live["rule"]:
                problems.append(
                    f"param group {gi} was saved with rule {saved.get('rule')!r}, the "
                    f"optimizer runs {live['rule']!r}; build the optimizer with the rule "
                    "the checkpoint was trained with"
                )
            for key in _LAYOUT:
                if key in saved and _plain(saved[key]) != _plain(live.get(key)):
                    problems.append(
                        f"param group {gi} was saved with {key}={saved[key]!r}, the optimizer "
                        f"has {key}={live.get(key)!r}: the state is laid out by it; build the "
                        f"group with {key}={saved[key]!r}, as the checkpoint was trained"
                    )
            names = list(saved.get("params") or [])
            mine = by_group.get(gi, [])
            if set(names) != set(mine):
                lacking = sorted(set(mine) - set(names))
                surplus = sorted(set(names) - set(mine))
                problems.append(
                    f"param group {gi} holds other parameters in the checkpoint: missing "
                    f"{lacking[:4]}, unexpected {surplus[:4]}"
                )
        if not problems:  # the hyperparameters load_state_dict will check, checked now
            try:
                optimizer.check_param_groups(groups)
            except ValueError as err:
                problems.extend(str(err).splitlines())
    for h in holdings:
        group = current[h.group_index]
        for key, shape in expected_state_shapes(h, group).items():
            check(f"optim.state.{h.fqn}.{key}", shape)
    if problems:
        raise CheckpointMismatchError(problems)


def load_into_optimizer(
    optimizer: DMuon,
    holdings: Sequence[Holding],
    values: Mapping[str, Mapping[str, torch.Tensor]],
    groups: Sequence[Mapping[str, Any]],
) -> None:
    """Give ``values`` (``fqn → key → tensor``, what this rank holds) to the optimizer.

    Keys this rank does not hold (another rank owns the parameter) keep their
    placeholders; the groups take the checkpoint's hyperparameters (learning rates
    a scheduler changed, for instance).
    """
    by_param = {id(h.param): h for h in holdings}
    state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for gi, live in enumerate(optimizer.param_groups):
        ids = []
        for p in live["params"]:
            h = by_param[id(p)]
            mine = values.get(h.fqn, {})
            current = optimizer.state.get(p, {})
            state[index] = {k: as_loaded(mine.get(k, v), v) for k, v in current.items()}
            ids.append(index)
            index += 1
        group = {k: v for k, v in groups[gi].items() if k not in _NOT_HYPER}
        group["params"] = ids
        if "param_names" in live:
            group["param_names"] = live["param_names"]
        out_groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": out_groups})
