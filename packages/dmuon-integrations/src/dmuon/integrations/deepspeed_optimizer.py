"""What DeepSpeed's ZeRO-1/2 is handed in owner mode: the scalar parameters, DMuon behind.

ZeRO-1 and ZeRO-2 flatten every parameter group of their client optimizer into one
vector and give each rank a slice of it: a matrix would reach the optimizer as a
piece of a flat vector, and orthogonalising pieces is not Muon. So in owner mode
DeepSpeed is handed only the *scalar* parameters (embeddings, head, norms, biases),
for which an elementwise optimizer on a slice is exact; the matrices are dedicated to
owner ranks (:mod:`dmuon.integrations.fsdp`'s hooks, outside ZeRO's flat buffers) and
stepped by a :class:`~dmuon.optim.DMuon` in owner mode.

ZeRO calls ``step()`` once per parameter group, with ``param_groups`` narrowed to that
group. :class:`ZeroClientOptimizer` runs AdamW/Lion on whatever groups it is shown
and runs the matrices' owner step once, together with the last group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dmuon.optim import SCALAR_ALGORITHMS, DMuon, get_scalar_rule
from dmuon.optim.optimizer_state import reload_scalar_state
from dmuon.optim.scalar import scalar_state_dtype
from dmuon.optim.sparse_gradients import first_sparse, sparse_gradient_error
from dmuon.optim.stepping import step_scalars

__all__ = ["ZeroClientOptimizer", "client_optimizer", "dmuon_of"]


class ZeroClientOptimizer(torch.optim.Optimizer):
    """DeepSpeed's client optimizer under ZeRO-1/2: AdamW/Lion on the scalars, then DMuon.

    Build it through :func:`dmuon.integrations.deepspeed.initialize`, which dedicates
    the matrices, builds ``dmuon`` in owner mode and hands this object to
    ``deepspeed.initialize``. Its ``param_groups`` are the scalar groups only (ZeRO
    replaces each group's parameters by this rank's slice of their flat fp32 copy);
    the matrices are reached through :attr:`dmuon`.

    The scalar step is exactly :func:`dmuon.optim.adamw_step` (or
    :func:`~dmuon.optim.lion_step`) with the group's hyperparameters, so on a slice
    it gives the slice of what :class:`~dmuon.optim.DMuon` gives on whole tensors.
    After the owner step the matrices' gradients are set to ``None`` (ZeRO's
    ``zero_grad`` only reaches its own parameters).

    Args:
        groups: the scalar parameter groups: dicts with ``params``, ``"rule"``
            (``"adamw"`` or ``"lion"``), ``lr``, ``betas``, ``weight_decay`` and, for
            AdamW, ``eps``.
        dmuon: the :class:`~dmuon.optim.DMuon` (owner mode) stepping the matrices.

    Attributes:
        dmuon_state_loaded_separately: set by
            :func:`dmuon.integrations.deepspeed.load_checkpoint` while it loads ZeRO's
            part, whose DMuon part it loads next (:meth:`load_state_dict` refuses
            otherwise).

    Raises:
        ValueError: a group with no parameters, an unknown rule, a missing or
            bad hyperparameter (named).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.zeros(4))
        >>> opt = ZeroClientOptimizer(
        ...     [{"params": [b], "rule": "adamw", "lr": 0.1, "betas": (0.9, 0.95),
        ...       "eps": 1e-8, "weight_decay": 0.0}],
        ...     DMuon([w], lr=0.02),
        ... )
        >>> w.grad, b.grad = torch.ones(4, 4), torch.ones(4)
        >>> opt.step()
        >>> round(b[0].item(), 3), w.grad is None
        (-0.1, True)
    """

    def __init__(self, groups: Iterable[Mapping[str, Any]], dmuon: DMuon) -> None:
        checked = [_check_group(g, i) for i, g in enumerate(groups)]
        if not checked:
            raise ValueError(
                "ZeroClientOptimizer needs at least one scalar parameter group for ZeRO to "
                "partition; a model of matrices only does not need ZeRO (use stage 0)"
            )
        super().__init__(checked, {})
        self.dmuon = dmuon
        # ZeRO narrows param_groups to one group per call; the group dicts stay the same
        # objects (ZeRO only swaps their "params"), so the last one marks the end of a step.
        self._last_group = self.param_groups[-1]
        # Set by dmuon.integrations.deepspeed.load_checkpoint, which loads DMuon's state next.
        self.dmuon_state_loaded_separately = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step the scalar groups shown in ``param_groups``; with the last one, the matrices.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._scalar_step(group)
        if self.param_groups and self.param_groups[-1] is self._last_group:
            self.dmuon.step()
            self.dmuon.zero_grad(set_to_none=True)
        return loss

    def _scalar_step(self, group: Mapping[str, Any]) -> None:
        """The same scalar rule step as DMuon's scalar groups (``dmuon.optim.stepping``).

        Raises:
            RuntimeError: a gradient is sparse (named); nothing of the group is stepped.
        """
        # DMuon.step checks its own groups for sparse gradients; these are ZeRO's
        params = group["params"]
        i = first_sparse(p.grad for p in params)
        if i is not None:
            raise sparse_gradient_error(_scalar_name(group, i, params[i]))
        for p in group["params"]:
            if p.grad is not None:
                self._state_of(p, group["rule"])
        step_scalars(group, self.state)

    def _state_of(self, p: torch.Tensor, algorithm: str) -> dict[str, torch.Tensor]:
        # Lazily, like torch.optim.AdamW: ZeRO replaces the parameters after construction.
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for name in get_scalar_rule(algorithm).buffers:
                state[name] = torch.zeros_like(
                    p, dtype=scalar_state_dtype(p), memory_format=torch.preserve_format
                )  # fp32 for fp16/bf16 parameters, as in DMuon
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ZeRO's scalar state; refused unless DMuon's state is loaded too.

        ZeRO-1/2 call this from ``engine.load_checkpoint`` with this rank's scalar
        state. The matrices' momentum is DMuon's, outside ZeRO's files: loading only
        the scalars would go on training with it at zero. So this raises, before
        anything changes, unless :func:`dmuon.integrations.deepspeed.load_checkpoint`
        (which loads DMuon's state right after) is the caller.

        Raises:
            RuntimeError: called by ``engine.load_checkpoint`` directly.
        """
        if not self.dmuon_state_loaded_separately:
            raise RuntimeError(
                "engine.load_checkpoint would restore ZeRO's scalar optimizer state but not "
                "DMuon's matrix momentum (held by the owner ranks, outside ZeRO's files), and "
                "training would go on with it at zero. Save with "
                "dmuon.integrations.deepspeed.save_checkpoint(engine, dir) and load with "
                "dmuon.integrations.deepspeed.load_checkpoint(engine, dir); to load only the "
                "weights, pass load_optimizer_states=False"
            )
        super().load_state_dict(state_dict)
        # torch cast the fp32 state of fp16/bf16 parameters down to their dtype
        reload_scalar_state(self.param_groups, self.state, state_dict)
        # torch's load_state_dict replaces the group dicts (same parameters, new dicts).
        self._last_group = self.param_groups[-1]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the scalar parameters' and the matrices' gradients."""
        super().zero_grad(set_to_none=set_to_none)
        self.dmuon.zero_grad(set_to_none=set_to_none)


def _scalar_name(group: Mapping[str, Any], i: int, p: torch.Tensor) -> str:
    """How errors name parameter ``i`` of a scalar group (ZeRO shows one group at a time:
    no index among the groups)."""
    names = group.get("param_names")
    name = repr(names[i]) if names is not None and i < len(names) else str(i)
    where = f"scalar group {group['name']!r}" if "name" in group else "a scalar group"
    return f"parameter {name} of {where} (shape {tuple(p.shape)})"


def _check_group(group: Mapping[str, Any], index: int) -> dict[str, Any]:
    where = f"scalar group {index}"
    algorithm = group.get("rule")
    if algorithm not in SCALAR_ALGORITHMS:
        raise ValueError(f"{where}: rule must be one of {SCALAR_ALGORITHMS}, got {algorithm!r}")
    params = list(group.get("params", ()))
    if not params:
        raise ValueError(f"{where} has no parameters (drop empty groups)")
    out: dict[str, Any] = {"params": params, "rule": algorithm}
    options = get_scalar_rule(algorithm).options
    for key, option in options.items():
        if key not in group:
            if option.default is not None:  # an optional key (cautious_weight_decay)
                out[key] = option.default
                continue
            accepted = sorted(options)
            raise ValueError(f"{where}: missing {key!r} (accepted keys: {accepted})")
        out[key] = option.check(group[key])
    for key in ("name", "param_names"):
        if key in group:
            out[key] = group[key]
    return out


def client_optimizer(engine: Any) -> Any:
    """The optimizer a DeepSpeed engine was given (``basic_optimizer``; else ``optimizer``)."""
    return getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)


def dmuon_of(engine: Any) -> DMuon:
    """The :class:`~dmuon.optim.DMuon` behind a DeepSpeed engine made by :func:`initialize`.

    Examples:
        >>> dmuon_of(engine).mode  # doctest: +SKIP
        'owner'
    """
    opt = client_optimizer(engine)
    if isinstance(opt, DMuon):
        return opt
    if isinstance(opt, ZeroClientOptimizer):
        return opt.dmuon
    raise TypeError(
        f"the engine's optimizer is a {type(opt).__name__}, not one made by "
        "dmuon.integrations.deepspeed.initialize"
    )
