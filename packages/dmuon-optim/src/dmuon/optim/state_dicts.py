"""``DMuon``'s state dicts: torch's, with the checks and restorations DMuon adds.

``torch.optim.Optimizer.state_dict``/``load_state_dict`` do the work; around them
DMuon adds what its state needs (:mod:`dmuon.optim.optimizer_state` holds the state
and its checks): the ``"distributed"`` entry a saved dict carries (mode, rank, plan,
owners), the checks a dict passes before anything changes, and the restoring of the
buffers torch's load casts. Each is registered as a hook of the call it serves, for
that call only, so that the caller's own hooks see what ``torch.optim`` promises them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dmuon.optim.engine.base import Engine
from dmuon.optim.group_options import GroupDefaults
from dmuon.optim.loaded_state import check_state_dict_keys, refuse_unloadable
from dmuon.optim.optimizer_state import reload_matrix_state, reload_scalar_state

__all__ = ["check_saved_groups", "load_checked", "with_distributed"]


def load_checked(
    optimizer: torch.optim.Optimizer,
    engine: Engine,
    state_dict: dict[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """``load(state_dict)`` (torch's ``load_state_dict``), checked before anything changes
    and with the state torch casts restored after (``DMuon.load_state_dict``).

    The caller's pre-hooks see the dict as given (DMuon's checks are registered last,
    so they check the dict those hooks return); the caller's post-hooks see the state as
    loaded, DMuon's restoring of its buffers already done, and what they change stays.
    """
    if not optimizer._optimizer_load_state_dict_pre_hooks:
        check_state_dict_keys(state_dict)
    seen: list[dict[str, Any]] = []  # the dict torch loads, after the caller's hooks

    def reload(_: torch.optim.Optimizer) -> None:
        # torch cast the state of fp16/bf16 parameters to their dtype (fp32 scalar
        # state, matrix state with state_dtype="float32"); undo it. A post-hook put
        # first, so that the caller's own post-hooks see (and may change) the state as
        # loaded: run after them, this copy would overwrite what they changed.
        loaded = seen[-1] if seen else state_dict
        reload_scalar_state(optimizer.param_groups, optimizer.state, loaded)
        reload_matrix_state(optimizer.param_groups, optimizer.state, loaded)

    # Registered for this call only (not in the constructor): hooks are not pickled,
    # and prepended here no post-hook of the caller's, prepended or not, runs first.
    handles = [
        optimizer.register_load_state_dict_pre_hook(refuse_unloadable(engine)),
        optimizer.register_load_state_dict_pre_hook(lambda _, sd: seen.append(sd)),
        optimizer.register_load_state_dict_post_hook(reload, prepend=True),
    ]
    try:
        load(state_dict)
    finally:
        for handle in handles:
            handle.remove()


def with_distributed(
    optimizer: torch.optim.Optimizer, engine: Engine, save: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``save()`` (torch's ``state_dict``) with ``"distributed"``: ``engine.describe()``.

    The entry is added before the caller's state-dict post-hooks run (a post-hook put
    first, for this call only), so that they see, and may change or drop, the whole
    dict (``DMuon.state_dict``).
    """

    def describe(_: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        sd["distributed"] = engine.describe()

    handle = optimizer.register_state_dict_post_hook(describe, prepend=True)
    try:
        return save()
    finally:
        handle.remove()


def check_saved_groups(
    defaults: GroupDefaults,
    saved: Sequence[Mapping[str, Any]],
    live: Sequence[Mapping[str, Any]],
) -> None:
    """Check saved param groups against the ``live`` ones as the constructor checks a
    group, changing nothing (``DMuon.check_param_groups``).

    Group ``i`` of ``saved`` goes with ``live`` group ``i`` and its parameters; the
    saved ``params``/``param_names`` are not read.

    Raises:
        ValueError: another number of groups, or groups whose keys or values do not
            check (one line per group).
    """
    if len(saved) != len(live):
        raise ValueError(f"{len(saved)} param group(s) given, the optimizer has {len(live)}")
    problems = []
    for index, (given, own) in enumerate(zip(saved, live, strict=True)):
        group = {k: v for k, v in given.items() if k not in ("params", "param_names")}
        group["params"] = own["params"]
        if "param_names" in own:
            group["param_names"] = own["param_names"]
        try:
            defaults.normalize(group, index)
        except (ValueError, TypeError) as err:
            problems.append(str(err))
    if problems:
        raise ValueError("\n".join(problems))
