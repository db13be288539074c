"""Option names of DMuon's groups: which keys a rule takes, and the errors for the others.

A key no rule of the groups takes is refused, never ignored (a misspelt ``momentun``
would silently train with the default, and the optimizer's own state dict would not
load). The errors say what was probably meant: the rule that does take an option
(``beta2`` is NorMuon's), the closest accepted name for a misspelt one, DMuon's spelling
of ``torch.optim.AdamW``'s keywords (``adamw_betas``), an option a rule renamed
(:data:`RENAMED_OPTIONS`) and the deprecated group key ``"algorithm"``.
"""

from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Collection, Mapping
from types import FrameType
from typing import Any

from dmuon.optim.hyperparameters import BOOKKEEPING_KEYS, MATRIX_KEYS
from dmuon.optim.rules import RULES, get_rule
from dmuon.optim.scalar import SCALAR_ALGORITHMS, get_scalar_rule

__all__ = [
    "RENAMED_OPTIONS",
    "SCALAR_KEYWORDS",
    "accepted_options",
    "did_you_mean",
    "refuse_unknown_keys",
    "refuse_unused_options",
    "renamed_hint",
    "renamed_rule_key",
]

# torch.optim.AdamW's keywords, which DMuon's constructor spells for its scalar groups
SCALAR_KEYWORDS = {"betas": "adamw_betas", "eps": "adamw_eps"}
# Options a rule took under another name: (rule, old key) → its key now. Said in the errors
# of a constructor keyword or a loaded group that still uses the old one.
RENAMED_OPTIONS = {("muon2", "eps"): "muon2_eps"}


def accepted_options(rule_name: str) -> Mapping[str, Any]:
    """The keys a group of ``"rule"`` takes, each with its :class:`Option`."""
    if rule_name in SCALAR_ALGORITHMS:
        return dict(get_scalar_rule(rule_name).options)
    return {**MATRIX_KEYS, **get_rule(rule_name).options}


def refuse_unused_options(
    rule: str,
    rule_options: Mapping[str, Any],
    groups: list[dict[str, Any]],
    keywords: Collection[str] = (),
) -> None:
    """Raise if a caller's rule option (``DMuon(**rule_options)``) is taken by no rule of
    the ``groups`` nor by ``rule``, the default (``keywords``: the constructor's own,
    offered for a misspelt one).

    Raises:
        ValueError: naming the unused options, the rules, a hint per option and the
            accepted options.
    """
    used = set(MATRIX_KEYS) | set(get_rule(rule).options)
    for group in groups:
        if group["rule"] in RULES:
            used |= set(get_rule(group["rule"]).options)
    unused = sorted(set(rule_options) - used)
    if unused:
        rules_used = sorted({g["rule"] for g in groups} & set(RULES) | {rule})
        renamed = [
            f"{key}= is {SCALAR_KEYWORDS[key]}= here" for key in unused if key in SCALAR_KEYWORDS
        ]
        hint = (
            f" ({'; '.join(renamed)}: DMuon's keywords for the AdamW/Lion of the scalar "
            "groups start with adamw_"
            + (
                "; torch.optim.Muon's eps, the floor of its Newton–Schulz "
                "normalisation, has no keyword here: DMuon's guard is relative, "
                "‖X‖_F + 1e-7·max|X|"
                if "eps" in unused
                else ""
            )
            + ")"
            if renamed
            else ""
        )
        for rule in rules_used:
            hint += renamed_hint(rule, unused)
        hint += did_you_mean([k for k in unused if k not in SCALAR_KEYWORDS], used, keywords)
        raise ValueError(
            f"unknown option(s) {unused} for rule(s) {rules_used}{hint}; accepted options: "
            f"{sorted(used)}"
        )


def refuse_unknown_keys(group: Mapping[str, Any], where: str, *, added: bool = False) -> None:
    """Raise if ``group`` holds a key its ``"rule"`` does not take (nor bookkeeping:
    :data:`~dmuon.optim.hyperparameters.BOOKKEEPING_KEYS`). A misspelt key would be
    ignored silently, and the optimizer's own state dict would not load.

    Args:
        group: a group whose ``"rule"`` is resolved (a name of ``RULES`` or a scalar
            optimizer).
        where: how errors name the group.
        added: the key was added after construction (``step()`` found it): said so.

    Raises:
        ValueError: naming the unknown keys, the rule and the accepted keys.
    """
    rule_name = group["rule"]
    keys = accepted_options(rule_name)
    unknown = sorted(k for k in group if k not in keys and k not in BOOKKEEPING_KEYS)
    if rule_name in SCALAR_ALGORITHMS and "max_momentum" in group and "momentum" in unknown:
        # OneCycleLR/CyclicLR(cycle_momentum=True) write "momentum" into every
        # group; it cycles the matrix groups' μ and is ignored by AdamW/Lion.
        unknown.remove("momentum")
    if unknown:
        when = " (set after construction; nothing was stepped)" if added else ""
        raise ValueError(
            f"{where}: unknown key(s) {unknown} for rule {rule_name!r}{when}"
            f"{renamed_hint(rule_name, unknown)}; accepted keys: "
            f"{sorted(keys)} (and {sorted(BOOKKEEPING_KEYS)})"
        )


def renamed_hint(rule: str, keys: Collection[str]) -> str:
    """`` (rule 'muon2' names eps muon2_eps now: rename the key)`` for keys of
    :data:`RENAMED_OPTIONS`, else ``""``."""
    moved = [(k, RENAMED_OPTIONS[(rule, k)]) for k in keys if (rule, k) in RENAMED_OPTIONS]
    return "".join(
        f" (rule {rule!r} names {old} {new} now: rename the key; {old} is another rule's "
        "option with another meaning)"
        for old, new in moved
    )


def did_you_mean(unknown: list[str], used: set[str], keywords: Collection[str]) -> str:
    """A hint per unknown keyword: the rules that take it (``beta2`` is NorMuon's), or the
    closest of the rules' options and the constructor's ``keywords`` for a misspelt one
    (``adamw_lr`` and ``mode`` are not rule options: the error's accepted list lacks them)."""
    takers: dict[str, list[str]] = {}
    for name in RULES:
        for key in get_rule(name).options:
            takers.setdefault(key, []).append(name)
    known = sorted(set(used) | set(keywords) | set(takers))
    hints = []
    for key in unknown:
        if key in takers:
            hints.append(f"{key}= is an option of rule(s) {sorted(takers[key])}")
        elif match := difflib.get_close_matches(key, known, 1, 0.75):
            hints.append(f"{key}=: did you mean {match[0]}=?")
    return f" ({'; '.join(hints)})" if hints else ""


def renamed_rule_key(group: dict[str, Any], where: str) -> dict[str, Any]:
    """Move a group's deprecated ``"algorithm"`` key to ``"rule"`` in place (with a
    ``FutureWarning``; the key is removed in 0.2) and return the group.

    Raises:
        ValueError: both keys are given and disagree (named).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     renamed_rule_key({"params": [], "algorithm": "scalar"}, "param group 0")
        {'params': [], 'rule': 'scalar'}
    """
    if "algorithm" not in group:
        return group
    legacy = group.pop("algorithm")
    if "rule" in group and group["rule"] != legacy:
        raise ValueError(
            f"{where}: 'rule'={group['rule']!r} and the deprecated 'algorithm'={legacy!r} "
            "disagree; give 'rule' only"
        )
    warnings.warn(
        f"{where}: the key 'algorithm' is deprecated and will be removed in 0.2; name the "
        "group's rule with 'rule' (as the constructor's rule=)",
        FutureWarning,
        stacklevel=_caller_stacklevel(),
    )
    group["rule"] = legacy
    return group


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by this module's caller at the
    first frame outside dmuon and torch: the user's ``DMuon(...)`` or the integration
    call that built it, however many library frames lie between (they differ per entry
    point and per Python release)."""
    frame: FrameType | None = sys._getframe(2)  # the caller of the warning function: level 2
    level = 2
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(
        ("dmuon.", "torch.")
    ):
        frame = frame.f_back
        level += 1
    return level
