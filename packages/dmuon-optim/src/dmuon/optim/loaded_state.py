"""A state dict checked before it loads into :class:`~dmuon.optim.DMuon`.

``torch.optim.Optimizer.load_state_dict`` takes any dict of the right nesting; DMuon
refuses, before anything changes and with a message saying what would be right, what
would corrupt its state: a dict that is not an optimizer's, groups or parameters that
do not match, state of the wrong shape for this rank's share, an empty placeholder for
a parameter this rank steps (a dict saved by another rank, mode or world size), and
state holding a NaN or an Inf. The state itself, made eagerly, is
:mod:`dmuon.optim.optimizer_state`'s; the hooks around torch's load are
:mod:`dmuon.optim.state_dicts`'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dmuon.optim.engine.base import Engine
from dmuon.optim.engine.params import is_dtensor
from dmuon.optim.group_options import param_name
from dmuon.optim.matrix_split import MatrixSplit, local_tensor
from dmuon.optim.optimizer_state import FULL_STATE_FORMAT, expected_state_shapes, paired_states
from dmuon.optim.rules import RULES, get_rule
from dmuon.optim.scalar import SCALAR_ALGORITHMS
from dmuon.optim.wrapper_names import WRAPPER_NAMES

__all__ = [
    "check_loaded_state",
    "check_state_dict_keys",
    "refuse_nonfinite_state",
    "refuse_out_of_domain_state",
    "refuse_unloadable",
    "second_moment_keys",
]


def check_state_dict_keys(state_dict: Any) -> None:
    """Raise unless ``state_dict`` is a dict with ``"state"`` and ``"param_groups"``."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing and state_dict.get("format") == FULL_STATE_FORMAT:  # a Lightning checkpoint's
        raise ValueError(
            "this is the whole optimizer state of a DMuon in owner mode, as "
            "dmuon.integrations.lightning.DMuonStrategy writes it into a Lightning "
            "checkpoint (every owner's share, by parameter name), not a state dict of "
            "this optimizer: resume under DMuonStrategy (any number of devices, one "
            "included), which gives each rank its share (outside Lightning: "
            "dmuon.integrations.checkpoint.load_full_state_dict with this dict's 'optim')"
        )
    if missing:
        raise ValueError(
            f"state dict is missing key(s) {missing}; an optimizer state dict has "
            "'state' and 'param_groups'"
        )


def check_loaded_state(
    state: Mapping[Any, Any],
    groups: list[dict[str, Any]],
    on_shard: Callable[[torch.Tensor], bool] | None = None,
    split_of: Callable[[torch.Tensor], MatrixSplit | None] | None = None,
) -> None:
    """Raise unless ``state`` has exactly the keys and shapes ``groups`` need.

    A matrix the engine steps on this rank's local part (``on_shard``: a tensor-parallel
    shard, or the experts of a stack split over its expert dimension) has state shaped
    like its local shard, or like the split's ``local_shape`` when ``split_of`` gives
    one (``sharded`` mode's owner under FSDP2 over tensor parallelism holds its whole
    ``tp`` shard); under a rule that needs whole matrices (which gathers the shards),
    like the whole matrix.
    """
    params = {p for g in groups for p in g["params"]}
    extra = [k for k in state if not (isinstance(k, torch.Tensor) and k in params)]
    if extra:
        raise ValueError(
            f"state dict has state for parameter id(s) {extra} that belong to no group of "
            "this optimizer"
        )
    for gi, g in enumerate(groups):
        names = g.get("param_names")
        for i, p in enumerate(g["params"]):
            name = param_name(names, i, gi, p)
            expected = expected_state_shapes(g, p, name, on_shard, split_of)
            st = state.get(p)
            if st is None:
                raise ValueError(
                    f"state dict has no state for {name}; expected keys {sorted(expected)}"
                )
            missing = sorted(set(expected) - set(st))
            surplus = sorted(set(st) - set(expected))
            if missing or surplus:
                raise ValueError(
                    f"state of {name} (rule {g['rule']!r}): missing key(s) "
                    f"{missing}, unexpected key(s) {surplus}; expected {sorted(expected)}"
                )
            for key, shape in expected.items():
                value = st[key]
                if key != "step" and isinstance(value, torch.Tensor) and value.numel() == 0:
                    continue  # a placeholder: another rank steps this parameter
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    raise ValueError(f"state {key!r} of {name} has shape {got}; expected {shape}")


def refuse_unloadable(engine: Engine) -> Callable[[torch.optim.Optimizer, dict[str, Any]], None]:
    """A load-state-dict pre-hook: raise, before anything changes, on a dict that torch
    would load wrongly without a word.

    * Its groups name other parameters than the optimizer's (groups or parameters in
      another order: torch would pair each saved state and group with the wrong
      parameter).
    * A group was saved with another rule (the load would switch it past the checks of
      the mode, e.g. ``sign`` mode's vote).
    * A state tensor was saved as a DTensor where the optimizer keeps a plain tensor,
      or the reverse (a dict saved in another mode: FSDP2's DTensor state against a
      plain one); torch's copy would fail half-way, leaving the state mixed.
    * It holds a placeholder (an empty tensor, state another rank keeps) where this
      rank holds full state: loading it would restart the parameter's momentum from
      zero. The pattern is read off the optimizer's live state, which
      :func:`build_state` shaped after what this rank steps.

    * A state tensor holds a NaN or an Inf (:func:`refuse_nonfinite_state`): the next
      step would write it into the weights, with no gradient to blame.

    The first three are the same on every rank, so every rank refuses alike. The last
    two depend on what this rank's dict holds: a rank that refuses raises before torch
    changes anything, and its peers, which loaded, raise
    :class:`~dmuon.comm.CollectiveError` at the deadline of their next step's first
    collective (or at once, when the refusing process exits), never hang. Malformed
    dicts are left to the checks that name them (torch's group sizes,
    :func:`check_loaded_state`).
    """

    def hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("distributed")
        if isinstance(saved, Mapping):
            engine.check_loaded_description(saved)
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(opt.param_groups):
            return
        for gi, (live, saved) in enumerate(zip(opt.param_groups, saved_groups, strict=True)):
            if isinstance(saved, Mapping):
                _refuse_other_group(gi, live, saved)
        for pair in paired_states(opt.param_groups, opt.state, state_dict):
            for key, mine in pair.mine.items():
                other = pair.theirs.get(key)
                if not (isinstance(mine, torch.Tensor) and isinstance(other, torch.Tensor)):
                    continue
                if is_dtensor(mine) != is_dtensor(other):
                    kinds = ("a DTensor", "a plain tensor")
                    raise ValueError(
                        f"state {key!r} of {pair.name} was saved as "
                        f"{kinds[not is_dtensor(other)]}, and this optimizer keeps "
                        f"{kinds[not is_dtensor(mine)]}: the dict was saved in another "
                        "mode (FSDP2's sharded parameters against plain ones). Load it "
                        "in the mode it was saved in, or save and load across modes "
                        "with dmuon.integrations.checkpoint"
                    )
                if is_dtensor(mine) and mine.device_mesh != other.device_mesh:  # type: ignore[attr-defined]
                    raise ValueError(
                        f"state {key!r} of {pair.name} was saved as a DTensor on a mesh of "
                        f"ranks {_mesh_ranks(other)}, and this optimizer keeps it on ranks "
                        f"{_mesh_ranks(mine)}: the dict was saved at another world size or "
                        "on another mesh (torch's copy would fail half-way, leaving the "
                        "state mixed). Load it where it was saved, or save and load across "
                        "world sizes with dmuon.integrations.checkpoint"
                    )
                if key != "step" and mine.numel() > 0 and other.numel() == 0:
                    raise ValueError(
                        _foreign_placeholder_message(engine, state_dict, key, pair.name)
                    )
        refuse_out_of_domain_state(opt.param_groups, opt.state, state_dict)
        refuse_nonfinite_state(opt.param_groups, opt.state, state_dict)

    return hook


def second_moment_keys(rule: Any) -> frozenset[str]:
    """The state keys of ``rule`` that hold running means of squares, never negative:
    AdamW's ``exp_avg_sq`` and a matrix rule's state declared ``squares=True``."""
    if rule in SCALAR_ALGORITHMS:
        return frozenset({"exp_avg_sq"})
    if rule in RULES:
        return frozenset(s.name for s in get_rule(rule).state_specs() if s.squares)
    return frozenset()


def refuse_out_of_domain_state(
    groups: list[dict[str, Any]], state: Mapping[Any, Any], state_dict: Mapping[str, Any]
) -> None:
    """Raise ``ValueError``, naming the parameter and the key, on a saved state value of
    the wrong type or outside its domain, before torch changes anything.

    * A value where the optimizer keeps a tensor must be a tensor: torch's load casts
      other values first (a string ``"3"`` came out as a generator, and the shape
      check named *that*), so the type is checked here, before any shape.
    * ``step`` is a count, never negative: AdamW's bias correction ``1 − β^step`` is 0
      at ``step = -1`` (``ZeroDivisionError``, after the matrix groups had stepped) and
      its square root's argument negative below.
    * A second moment (:func:`second_moment_keys`) is a running mean of squares, never
      negative: a negative ``exp_avg_sq`` made the next step's ``√v`` NaN, written into
      the weights without a word (the non-finite guard reads the gradients).

    One read of the minima of all the tensors checked (a DTensor by its local part, a
    placeholder passed over).
    """
    checked: list[tuple[str, str, torch.Tensor]] = []  # (name, key, local tensor)
    for pair in paired_states(groups, state, state_dict):
        moments = second_moment_keys(pair.group.get("rule"))
        for key, mine in pair.mine.items():
            if key not in pair.theirs or not isinstance(mine, torch.Tensor):
                continue
            value = pair.theirs[key]
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"state {key!r} of {pair.name} is a {type(value).__name__} "
                    f"({value!r:.60}); expected a tensor of shape {tuple(mine.shape)} "
                    f"(as this optimizer's state_dict() saves it)"
                )
            if key == "step" or key in moments:
                local = local_tensor(value)
                if local.numel() and not local.is_complex() and local.dtype != torch.bool:
                    checked.append((pair.name, key, local))
    if not checked:
        return
    minima = torch.stack([t.min().to(torch.float64).cpu() for _, _, t in checked]).tolist()
    for (name, key, t), low in zip(checked, minima, strict=True):
        if low < 0:  # NaN compares False: refuse_nonfinite_state names it
            what = "a step count" if key == "step" else "a running mean of squares"
            raise ValueError(
                f"state {key!r} of {name} holds a negative value ({low:g}, "
                f"{int((t < 0).sum())} of {t.numel()} entries); it is {what}, never "
                "negative, and the next step would divide by zero or write NaN into the "
                "weights. The dict is corrupt or was edited: load one this optimizer "
                "saved; the optimizer is unchanged"
            )


def refuse_nonfinite_state(
    groups: list[dict[str, Any]], state: Mapping[Any, Any], state_dict: Mapping[str, Any]
) -> None:
    """Raise ``ValueError`` naming the parameter and the state key of the first saved
    floating-point state tensor of ``state_dict`` that holds a NaN or an Inf.

    A NaN momentum (a run saved after its state was poisoned, a corrupted file) passes
    every shape check, and the next step writes it into the weights: the step's
    non-finite guard reads the gradients, not the state. One fused pass: the max-abs
    norm of every tensor (a NaN or an Inf entry makes it NaN or Inf, and finite entries
    cannot overflow it, as an ℓ2 norm of entries near 3e38 would) in one
    ``torch._foreach_norm`` per device, then one read of all of them. A DTensor is
    checked by its local part (each rank its own shard), a placeholder (empty: state
    another rank keeps) is passed over.

    Examples:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> groups = [{"params": [w], "param_names": ["w"]}]
        >>> saved = {"state": {0: {"momentum_buffer": torch.full((2, 2), float("nan"))}},
        ...          "param_groups": [{"params": [0]}]}
        >>> try:
        ...     refuse_nonfinite_state(groups, {w: {}}, saved)
        ... except ValueError as err:
        ...     print(str(err)[:45])
        state 'momentum_buffer' of parameter 'w' (par
    """
    found: list[tuple[str, str, torch.Tensor]] = []  # (name, key, local tensor)
    for pair in paired_states(groups, state, state_dict):
        for key, value in pair.theirs.items():
            if not isinstance(value, torch.Tensor):
                continue
            local = local_tensor(value)
            if local.numel() and (local.is_floating_point() or local.is_complex()):
                found.append((pair.name, key, local))
    if not found:
        return
    # by device and dtype: the norm is taken in float32, or in the tensor's own dtype
    # where that is wider (float64 refuses to narrow: a float64 model's own dict failed)
    by_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, _, t) in enumerate(found):
        by_device.setdefault((t.device, t.dtype), []).append(i)
    finite = [True] * len(found)
    for (_, dtype), indices in by_device.items():
        # a complex tensor's norm is taken in its own dtype (a real one is refused)
        wide = None if dtype.is_complex else torch.promote_types(dtype, torch.float32)
        norms = torch._foreach_norm([found[i][2] for i in indices], math.inf, dtype=wide)
        for i, ok in zip(indices, torch.isfinite(torch.stack(norms)).tolist(), strict=True):
            finite[i] = ok
    bad = [found[i] for i, ok in enumerate(finite) if not ok]
    if bad:
        name, key, t = bad[0]
        more = f" (and {len(bad) - 1} more state tensor(s))" if len(bad) > 1 else ""
        raise ValueError(
            f"state {key!r} of {name} holds a NaN or an Inf ({int((~t.isfinite()).sum())} "
            f"of {t.numel()} entries){more}: the next step would write it into the "
            "weights. Load a state dict saved before the state went non-finite (an "
            "earlier checkpoint); the optimizer is unchanged"
        )


def _mesh_ranks(t: torch.Tensor) -> list[int]:
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _refuse_other_group(gi: int, live: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Raise if saved group ``gi`` names other parameters or another rule than ``live``."""
    mine, theirs = live.get("param_names"), saved.get("param_names")
    if mine is not None and theirs is not None and _unwrapped(mine) != _unwrapped(theirs):
        raise ValueError(
            f"param group {gi} of the state dict holds {_listed(theirs)}, this "
            f"optimizer's holds {_listed(mine)}: the groups or their parameters are "
            "in another order than when it was saved, and each saved state would "
            "go to another parameter. Build the param groups as they were built "
            "for the save (param_groups(model) on the same model), or load with "
            "dmuon.integrations.checkpoint, which matches by name"
        )
    rule = saved.get("rule", saved.get("algorithm"))  # "algorithm": older dicts
    if isinstance(rule, str) and "rule" in live and rule != live["rule"]:
        raise ValueError(
            f"param group {gi} of the state dict was saved with rule {rule!r}, this "
            f"optimizer's steps it with {live['rule']!r}: a rule is chosen when the "
            "optimizer is built, where its mode checks it (and the state is built for "
            f"it). Build the optimizer with rule={rule!r} for this group to resume it"
        )


def _unwrapped(names: Any) -> list[str]:
    return [".".join(c for c in str(n).split(".") if c not in WRAPPER_NAMES) for n in names]


def _listed(names: Any) -> str:
    names = list(names)
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return f"{names[:4]}{more}"


def _foreign_placeholder_message(
    engine: Engine, state_dict: Mapping[str, Any], key: str, name: str
) -> str:
    saved = state_dict.get("distributed")
    if isinstance(saved, Mapping) and "rank" in saved:
        saver = (
            f"rank {saved['rank']} of {saved.get('world_size', '?')} in "
            f"{saved.get('mode', '?')!r} mode"
        )
    else:
        saver = "a rank it does not name (no 'distributed' entry)"
    return (
        f"state {key!r} of {name} is an empty placeholder in this state dict, saved by "
        f"{saver}, where another rank steps that parameter; this is rank {engine.rank} of "
        f"{engine.world_size} in {engine.mode!r} mode, which steps it, so loading would "
        "restart its state from zero. Load the state dict this same rank saved (same mode, "
        "world size and plan), or save and load with dmuon.integrations.checkpoint "
        "(save/load or full_state_dict/load_full_state_dict), which reshards the state to "
        "the ranks that step each parameter"
    )
