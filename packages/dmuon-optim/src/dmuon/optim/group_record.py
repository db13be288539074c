"""What ``DMuon.step`` checks each parameter group against before anything is stepped.

The constructor checks every group (:mod:`dmuon.optim.group_options`); a caller may
still change a group afterwards — a scheduler sets ``lr``, a user sets
``group["momentum"] = 1.5``, replaces a parameter's ``.data`` with another shape, or
hands in a sparse gradient. :class:`GroupRecord` keeps what the group's state was
built for and re-checks, at every step and cheaply, what changed since. A value held
as a one-element tensor (an ``lr`` tensor, as ``torch.optim`` takes it) stays the
caller's object in the group and is re-checked at every step, since the caller may
change it in place. :func:`group_values` gives the step's agreement a fingerprint of
every group's checked values, so that ranks holding different values are refused on
every rank (:func:`~dmuon.optim.engine.guards.agree_step`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dmuon.optim.engine.guards import GroupValues
from dmuon.optim.group_options import (
    STRUCTURE,
    accepted_options,
    check_together,
    check_value,
    param_name,
    refuse_unknown_keys,
    structure_of,
)
from dmuon.optim.sparse_gradients import first_sparse

__all__ = ["GroupRecord", "check_groups", "group_values"]

_MISSING = object()


@dataclass
class GroupRecord:
    """What ``step()`` checks group ``index`` against: what its state was built for.

    Taken when the group's state is (re)built. :meth:`check` runs at every step,
    before anything is stepped, and costs one pass over the group's parameters and
    keys (identity and shape comparisons; a value is re-checked only when the
    caller replaced it, as an LR scheduler does every step, or when it is a tensor the
    caller may have changed in place). It is the only look of
    the step for sparse gradients (:func:`~dmuon.optim.sparse_gradients.first_sparse`):
    it names the first it finds, and ``DMuon.step`` refuses the step on every rank
    (:func:`~dmuon.optim.engine.guards.agree_step`) before every mode's engine, the
    finiteness guard, the buckets and the scalar rules run (the gradients they read
    afterwards, reduced or gathered by the engine, are dense).

    Attributes:
        index: the group's position in ``param_groups``.
        structure: :func:`structure_of` the group.
        shapes: each parameter's shape.
        values: each accepted key's checked value.
        keys: the group's keys (a key added since is checked, e.g. a misspelt one).
    """

    index: int
    structure: tuple[Any, ...]
    shapes: tuple[torch.Size, ...]
    values: dict[str, Any] = field(default_factory=dict)
    keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self._shapes = list(self.shapes)  # what check compares a list of shapes with
        self._largest = max((math.prod(shape) for shape in self.shapes), default=1)
        self._digest: bytes | None = None  # of values, while none is a tensor
        self.label = f"group{self.index}"  # who the group is across ranks (see of)

    @classmethod
    def of(cls, group: Mapping[str, Any], index: int) -> GroupRecord:
        """The record of a group just normalised (its values are checked)."""
        options = accepted_options(group["rule"])
        record = cls(
            index,
            structure_of(group),
            tuple(p.shape for p in group["params"]),
            {k: group[k] for k in options if k in group},
            frozenset(group),
        )
        names = group.get("param_names")
        if names:  # by its parameters: ranks may list the same groups in another order
            text = repr(sorted(names)).encode()
            record.label = hashlib.blake2b(text, digest_size=8).hexdigest()
        return record

    def check(self, group: dict[str, Any]) -> str | None:
        """Raise if ``group`` no longer matches what its state was built for; return its
        first parameter with a sparse gradient, as errors name it (``None``: none).

        A sparse gradient is returned, not raised: ``DMuon.step`` refuses it on every rank
        of the step's agreement (:func:`~dmuon.optim.engine.guards.agree_step`), so that
        no rank is left waiting in a collective for one that raised alone.

        Raises:
            RuntimeError: its structure (:data:`STRUCTURE`, its parameters) changed, or a
                parameter's shape changed (its ``.data`` replaced) — each naming the
                parameter.
            ValueError: a value the caller set since the last step does not check, alone
                or with another (named with the key, as the constructor names it), or a
                key the rule does not take was added; nothing is stepped.
        """
        where = f"param group {self.index}"
        if structure_of(group) != self.structure:
            raise RuntimeError(
                f"{where} changed its structure ({', '.join(STRUCTURE)} or its "
                "parameters) after construction; create a new optimizer or use "
                "add_param_group" + self._flattened_hint(group)
            )
        params = group["params"]
        # one pass, in C; on a difference the loop below finds the first parameter at
        # fault, in the order it always named them
        if [p.shape for p in params] != self._shapes:
            names = group.get("param_names")
            for i, (p, shape) in enumerate(zip(params, self.shapes, strict=True)):
                if p.shape != shape:
                    raise RuntimeError(
                        f"{param_name(names, i, self.index, p)} changed shape: DMuon built "
                        f"its state for {tuple(shape)}. Its .data was replaced by a tensor "
                        "of another shape; keep the shape, or build a new optimizer for the "
                        "new parameters"
                    )
        self._check_values(group, where)
        at = first_sparse(p.grad for p in params)
        if at is None:
            return None
        return param_name(group.get("param_names"), at, self.index, params[at])

    def _flattened_hint(self, group: Mapping[str, Any]) -> str:
        """What to do when the group's matrices were replaced by flat 1-D tensors: what
        DeepSpeed's ZeRO stage 1/2 does to the groups of a client optimizer handed to
        ``deepspeed.initialize`` (one flat partition per group and rank)."""
        params = group["params"]
        if (
            params
            and all(p.dim() == 1 for p in params)
            and any(len(shape) >= 2 for shape in self.shapes)
        ):
            return (
                ". Its matrices were replaced by flat 1-D tensors, as DeepSpeed's ZeRO does "
                "to a client optimizer given to deepspeed.initialize (Muon would "
                "orthogonalise pieces of matrices): build it with "
                "dmuon.integrations.deepspeed.initialize(model, config, ...) instead"
            )
        return ""

    def _check_values(self, group: dict[str, Any], where: str) -> None:
        """Check each value the caller replaced since the last step, and each key added
        (:meth:`check`)."""
        if group.keys() != self.keys:
            refuse_unknown_keys(group, where, added=True)
            self.keys = frozenset(group)  # scheduler bookkeeping (initial_lr, ...)
        checked: dict[str, Any] = {}
        for key, value in self.values.items():
            now = group.get(key, _MISSING)
            if now is value and not isinstance(now, torch.Tensor):
                continue  # a tensor may have changed in place: re-checked every step
            if now is _MISSING:
                raise ValueError(f"{where}: key {key!r} was removed after construction")
            option = accepted_options(group["rule"])[key]
            checked[key] = check_value(key, now, option, where)
        if checked:  # recorded once every check passed: a refused value stays refused
            check_together({**group, **checked}, where, largest=self._largest)
            group.update(checked)
            self.values.update(checked)
            self._digest = None

    def described(self) -> dict[str, Any]:
        """Each checked value as the ranks compare it: plain numbers, strings and tuples
        (a tensor's current value as a float; an object by its type's name, as its
        ``repr`` may hold an address)."""
        return {k: _plain(v) for k, v in sorted(self.values.items())}

    def digest(self) -> bytes:
        """8 bytes of :attr:`label` and :meth:`described`, the same on every rank for the
        same group and values (kept until a value changes; re-read every step while one
        is a tensor). ``label``: the group's parameter names, when it has them (another
        rank may list the same groups in another order), else its index."""
        if self._digest is not None:
            return self._digest
        text = repr((self.label, self.described())).encode()
        digest = hashlib.blake2b(text, digest_size=8).digest()
        if not any(isinstance(v, torch.Tensor) for v in self.values.values()):
            self._digest = digest
        return digest


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    text = str(value)  # a dtype's name; an object's repr may hold its address
    return type(value).__qualname__ if " at 0x" in text else text


def group_values(records: Iterable[GroupRecord]) -> GroupValues:
    """The step's agreement's view of ``records`` (every group's): one fingerprint of
    their checked values, whatever the order of the groups, and how to name them when
    ranks differ."""
    records = list(records)
    h = hashlib.blake2b(digest_size=8)
    for digest in sorted(r.digest() for r in records):
        h.update(digest)
    return GroupValues(
        int.from_bytes(h.digest(), "little"),
        lambda: {r.label: (r.index, r.described()) for r in records},
    )


def check_groups(
    records: Mapping[int, GroupRecord], param_groups: Sequence[dict[str, Any]]
) -> tuple[str | None, Exception | None, GroupValues | None]:
    """What ``DMuon.step`` brings to its agreement from ``param_groups``: the first
    parameter with a sparse gradient (as errors name it), the error this rank's check of
    a group raised, and (none raised) every group's values (:func:`group_values`).

    Nothing is raised here: a rank raising alone would leave the others waiting in the
    step's first collective, so a refusal is agreed there and raised on every rank alike
    (:func:`~dmuon.optim.engine.guards.agree_step`). A group appended to ``param_groups``
    directly has no record: it is refused with the call that adds one.
    """
    sparse: str | None = None
    for index, group in enumerate(param_groups):
        try:
            if index not in records:
                raise RuntimeError(
                    f"param group {index} was appended to param_groups directly: DMuon "
                    "has no state or plan for it. Use opt.add_param_group(group)"
                )
            found = records[index].check(group)  # what the caller changed since
        except Exception as err:  # any error of a check: agreed, not raised alone
            return sparse, err, None
        sparse = sparse or found
    return sparse, None, group_values(records[i] for i in sorted(records))
