"""The scalar-parameter optimizers: AdamW and Lion, over lists with ``torch._foreach_*``.

Embeddings, output heads, norms, biases and scalars are not matrices in Muon's
sense; they take an elementwise optimizer in the same ``DMuon`` object. Each is a
:class:`ScalarRule` of :data:`SCALAR_RULES`, declaring its hyperparameters and its
state as a matrix rule's transforms do; whoever steps scalar parameters (DMuon's
engines, DeepSpeed's client optimizer) calls ``get_scalar_rule(algorithm).update``.

Mixed precision: the state of an fp16/bf16 parameter is fp32
(:func:`scalar_state_dtype`), and its step is computed in fp32 on a widened copy of
the parameter and gradient, then cast into the parameter once. In fp16, AdamW's
ε = 1e-8 rounds to 0 and ``exp_avg_sq`` underflows, so a zero gradient (an unused
embedding row, a bias) gave ``0/(√0 + 0)`` = NaN weights on the first step. fp32 and
fp64 parameters take the plain path: AdamW is then bit for bit ``torch.optim.AdamW``
wherever torch's result is finite.

AdamW's second moment stays finite for every finite gradient: an entry that would
overflow (the square of a gradient of 2e19 or more) saturates at its dtype's largest
value, where torch's would be ``inf`` for good (``_saturate_``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

from dmuon.optim.apply import decoupled_decay_
from dmuon.optim.hyperparameters import SCALAR_OPTIONS, Option
from dmuon.optim.matrix_split import PLAIN_TENSOR_TYPES, local_tensor
from dmuon.optim.state_precision import store_saturated

__all__ = [
    "SCALAR_ALGORITHMS",
    "SCALAR_RULES",
    "ScalarRule",
    "adamw_step",
    "get_scalar_rule",
    "lion_step",
    "scalar_state_dtype",
    "scalar_state_shapes",
]

_NARROW = (torch.float16, torch.bfloat16)


def scalar_state_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of a scalar rule's buffers for ``param``: fp32 for fp16/bf16, else its own.

    Examples:
        >>> import torch
        >>> scalar_state_dtype(torch.zeros(2, dtype=torch.float16))
        torch.float32
        >>> scalar_state_dtype(torch.zeros(2, dtype=torch.float64))
        torch.float64
    """
    return torch.float32 if param.dtype in _NARROW else param.dtype


def _pick(items: Sequence[torch.Tensor], index: list[int]) -> list[torch.Tensor]:
    return [items[i] for i in index]


def _step_in_fp32(
    step: Callable[
        [list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor]],
        None,
    ],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    buffers: Sequence[Sequence[torch.Tensor]],
    steps: Sequence[torch.Tensor],
) -> None:
    """``step(params, grads, buffers, steps)``, with fp16/bf16 parameters computed in fp32.

    Such a parameter's gradient and buffers are widened (an fp32 buffer is used in
    place; a narrow one, e.g. cast down by a loader, is widened and written back), the
    step runs on an fp32 copy of the parameter, and the result is cast back once.
    Other parameters are stepped as they are.
    """
    narrow = [i for i, p in enumerate(params) if p.dtype in _NARROW]
    if not narrow:
        step(list(params), list(grads), [list(b) for b in buffers], list(steps))
        return
    taken = set(narrow)
    rest = [i for i in range(len(params)) if i not in taken]
    if rest:
        step(_pick(params, rest), _pick(grads, rest), [_pick(b, rest) for b in buffers],
             _pick(steps, rest))  # fmt: skip
    wide_params = [params[i].float() for i in narrow]
    wide_buffers = [[b[i].float() for i in narrow] for b in buffers]
    step(wide_params, [grads[i].float() for i in narrow], wide_buffers, _pick(steps, narrow))
    # the one rounding; a DTensor (FSDP2's shard) by its local tensor, which writes
    # through: DTensor has no sharding rule for the foreach copy
    torch._foreach_copy_(
        [local_tensor(p) for p in _pick(params, narrow)], [local_tensor(w) for w in wide_params]
    )
    for b, wide in zip(buffers, wide_buffers, strict=True):
        for i, w in zip(narrow, wide, strict=True):
            if w is not b[i]:  # a narrow buffer: fp32's max would round to inf in it
                store_saturated(b[i], w)


def _saturate_(tensors: Sequence[torch.Tensor]) -> None:
    """Clamp each second moment in place to the largest finite value of its dtype (it
    is never negative: no lower clamp).

    AdamW's second moment stays finite for every finite gradient, as the matrix
    rules' momentum and second moments do (``saturate_`` in ``transforms``): a gradient
    entry of 2e19 or more (finite) squares past fp32's range, and an ``exp_avg_sq`` of
    ``inf`` stayed ``inf`` (``β₂·inf = inf``), so that entry's update was
    ``m̂/∞ = 0`` for the rest of the run and the checkpoint held ``inf``. Saturated, it
    decays by ``β₂`` a step like any other entry, and the entry barely moves until it
    has. Only an ``inf`` changes: every finite value stays bit for bit what
    ``torch.optim.AdamW`` computes, and NaN stays NaN. A DTensor is clamped through its
    local shard (DTensor has no sharding rule for the foreach ops).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        local = local_tensor(t)
        by_dtype.setdefault(local.dtype, []).append(local)
    for dtype, group in by_dtype.items():
        big = torch.finfo(dtype).max
        torch._foreach_clamp_max_(group, big)


def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    cautious: bool = False,
) -> None:
    """One AdamW step (Loshchilov & Hutter, arXiv 1711.05101) with torch's own functional.

    ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²``,
    ``W ← W(1 − lr·wd) − lr·m̂/(√v̂ + ε)`` with bias-corrected ``m̂``, ``v̂``:
    exactly :class:`torch.optim.AdamW` (torch's functional; its multi-tensor path for
    plain tensors, which gives the bits of the per-parameter loop torch picks on a CPU)
    for fp32/fp64 parameters; fp16/bf16 ones are computed in fp32 (fp32 ``exp_avg``,
    ``exp_avg_sq``) and cast once, so ε = 1e-8 does not round to 0.

    One departure, where torch's state overflows: ``exp_avg_sq`` is clamped to its
    dtype's largest finite value after the step, so a finite gradient
    spike whose square overflows leaves a saturated entry that decays by ``β₂``, not an
    ``inf`` that froze that entry (update 0) for the rest of the run. Every finite value
    is torch's, bit for bit.

    ``cautious`` (Chen et al., *Cautious Weight Decay*, arXiv 2510.12402): the decay
    applies only where the update ``u = m̂/(√v̂ + ε)`` agrees with the weight in sign,
    ``W ← W − lr·wd·𝟙[u⊙W ≥ 0]⊙W − lr·u``; ``u`` has the sign of the new ``m`` (the
    denominator and the bias correction are positive), so the mask is taken from it
    and the decay applied before torch's functional runs with ``weight_decay=0``.

    Examples:
        >>> import torch
        >>> p, g = torch.ones(3), torch.ones(3)
        >>> m, v, t = torch.zeros(3), torch.zeros(3), torch.zeros(())
        >>> adamw_step([p], [g], [m], [v], [t], lr=0.1, betas=(0.9, 0.95), eps=1e-8,
        ...            weight_decay=0.0)
        >>> round(p[0].item(), 4)
        0.9
    """

    masked = cautious and weight_decay != 0.0 and lr != 0.0

    def step(
        p: list[torch.Tensor],
        g: list[torch.Tensor],
        buffers: list[list[torch.Tensor]],
        t: list[torch.Tensor],
    ) -> None:
        if masked and p:
            # the new first moment, as torch's functional computes it next (lerp)
            moments = torch._foreach_lerp(buffers[0], g, 1.0 - betas[0])
            decoupled_decay_(p, moments, lr=lr, weight_decay=weight_decay, cautious=True)
        _torch_adamw(
            p,
            g,
            buffers[0],
            buffers[1],
            [],
            t,
            foreach=_foreach(p, g),
            amsgrad=False,
            beta1=betas[0],
            beta2=betas[1],
            lr=lr,
            weight_decay=0.0 if masked else weight_decay,
            eps=eps,
            maximize=False,
        )
        # exp_avg is left as torch's: it overflows only for gradients near fp32's max
        # (1.7e38), whose square makes that step's update NaN in torch's arithmetic
        # anyway; one clamp less is ~10% of this step's time (two foreach passes)
        _saturate_(buffers[1])

    _step_in_fp32(step, params, grads, (exp_avgs, exp_avg_sqs), steps)


def _foreach(params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool | None:
    """``True`` (torch's multi-tensor AdamW) for plain tensors whose gradients match them in
    dtype and device, or for DTensors (FSDP2's shards) on one mesh whose gradients match
    them in placements too; else ``None`` (torch picks, as ``torch.optim.AdamW`` does).

    Torch picks foreach on CUDA already; on a CPU it picks the loop of one Python call
    per op and parameter (``_single_tensor_adam``), which costs about as much as the
    rest of a DMuon step for a model of many small parameters — and for DTensors each of
    those calls goes through DTensor's dispatch: in ``sharded`` mode on FSDP2 it was
    five sixths of the step (``benchmarks/step_overhead.py``, ``dmuon_sharded``). On a
    CPU torch's foreach ops run the same per-tensor kernels in one C++ loop, in the same
    order, a DTensor's on its local shard: the same bits (``tests/test_scalar_rules.py``
    compares the two paths, ``tests-integration/test_sharded_scalars_foreach.py`` on
    FSDP2's shards).
    """
    kinds: set[str] = set()
    mesh: object = None
    for p, g in zip(params, grads, strict=True):
        if p.dtype != g.dtype or p.device != g.device:
            return None
        if type(p) in PLAIN_TENSOR_TYPES and type(g) in PLAIN_TENSOR_TYPES:
            kinds.add("plain")
            continue
        # a DTensor by its attributes (the engine's is_dtensor would import the engine)
        here, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if here is None or placements is None or (mesh is not None and here != mesh):
            return None
        if getattr(g, "device_mesh", None) != here or getattr(g, "placements", None) != placements:
            return None
        mesh = here
        kinds.add("dtensor")
    if len(kinds) > 1:
        return None  # plain tensors beside DTensors: torch's loop takes both
    return True


def lion_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    cautious: bool = False,
) -> None:
    """One Lion step (Chen et al., *Symbolic Discovery of Optimization Algorithms*, 2023).

    ``c = β₁m + (1−β₁)g``, ``W ← W(1 − lr·wd) − lr·sign(c)``, ``m ← β₂m + (1−β₂)g``;
    ``cautious`` (arXiv 2510.12402): ``W ← W − lr·wd·𝟙[sign(c)⊙W ≥ 0]⊙W − lr·sign(c)``.
    Source: arXiv 2302.06675. Lion's updates have RMS 1, so its learning rate is
    typically 3–10× smaller than AdamW's. fp16/bf16 parameters are computed in fp32
    (fp32 ``exp_avg``) and cast once.

    Examples:
        >>> import torch
        >>> p, g, m, t = torch.zeros(2), torch.tensor([1.0, -2.0]), torch.zeros(2), torch.zeros(())
        >>> lion_step([p], [g], [m], [t], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
        >>> tuple(round(x, 6) for x in p.tolist())
        (-0.1, 0.1)
    """
    beta1, beta2 = betas

    def step(
        p: list[torch.Tensor],
        g: list[torch.Tensor],
        buffers: list[list[torch.Tensor]],
        t: list[torch.Tensor],
    ) -> None:
        if not p:
            return
        (m,) = buffers
        directions = torch._foreach_lerp(m, g, 1.0 - beta1)
        torch._foreach_sign_(directions)
        decoupled_decay_(p, directions, lr=lr, weight_decay=weight_decay, cautious=cautious)
        torch._foreach_add_(p, directions, alpha=-lr)
        torch._foreach_lerp_(m, g, 1.0 - beta2)
        torch._foreach_add_(t, 1.0)

    _step_in_fp32(step, params, grads, (exp_avgs,), steps)


def _adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    group: Mapping[str, Any],
) -> None:
    adamw_step(
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["step"] for s in states],
        lr=float(group["lr"]),
        betas=group["betas"],
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        cautious=bool(group.get("cautious_weight_decay", False)),
    )


def _lion_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    group: Mapping[str, Any],
) -> None:
    lion_step(
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["step"] for s in states],
        lr=float(group["lr"]),
        betas=group["betas"],
        weight_decay=float(group["weight_decay"]),
        cautious=bool(group.get("cautious_weight_decay", False)),
    )


@dataclass(frozen=True)
class ScalarRule:
    """An elementwise optimizer for scalar parameters: its keys, its state, its step.

    Attributes:
        name: the group's ``"rule"`` value.
        options: the group keys it reads (name → :class:`~dmuon.optim.hyperparameters.Option`);
            their defaults come from the ``DMuon`` constructor (``adamw_*``).
        buffers: its state buffers, each shaped like the parameter, of dtype
            :func:`scalar_state_dtype` (fp32 for fp16/bf16 parameters); every scalar
            rule also keeps ``step``, a 0-dim fp32 count.
        step_fn: ``step_fn(params, grads, states, group)``, one step of every listed
            parameter in place (:func:`adamw_step`, :func:`lion_step`).
        summary: one line.
        source: the paper it follows.

    Examples:
        >>> import torch
        >>> rule = get_scalar_rule("adamw")
        >>> sorted(rule.options)
        ['betas', 'cautious_weight_decay', 'eps', 'lr', 'weight_decay']
        >>> rule.state_shapes(torch.zeros(3))
        {'step': (), 'exp_avg': (3,), 'exp_avg_sq': (3,)}
    """

    name: str
    options: Mapping[str, Option]
    buffers: tuple[str, ...]
    step_fn: Callable[
        [list[torch.Tensor], list[torch.Tensor], list[dict[str, torch.Tensor]], Mapping[str, Any]],
        None,
    ]
    summary: str = ""
    source: str = ""

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state keys of ``param`` under this rule and their shapes."""
        return {"step": (), **{name: tuple(param.shape) for name in self.buffers}}

    def update(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
        group: Mapping[str, Any],
    ) -> None:
        """One step of ``params`` (with their ``grads`` and ``states``) by ``group``'s values.

        Examples:
            >>> import torch
            >>> p, g = torch.zeros(2), torch.tensor([1.0, -2.0])
            >>> state = {"step": torch.zeros(()), "exp_avg": torch.zeros(2)}
            >>> group = {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.0}
            >>> get_scalar_rule("lion").update([p], [g], [state], group)
            >>> tuple(round(x, 6) for x in p.tolist()), state["step"].item()
            ((-0.1, 0.1), 1.0)
        """
        self.step_fn(list(params), list(grads), list(states), group)


def _keys(*names: str) -> dict[str, Option]:
    return {name: SCALAR_OPTIONS[name] for name in names}


SCALAR_RULES: dict[str, ScalarRule] = {
    r.name: r
    for r in (
        ScalarRule(
            "adamw",
            _keys("lr", "betas", "eps", "weight_decay", "cautious_weight_decay"),
            ("exp_avg", "exp_avg_sq"),
            _adamw_update,
            summary="Adam with decoupled weight decay (torch's own functional)",
            source="Loshchilov & Hutter, arXiv 1711.05101",
        ),
        ScalarRule(
            "lion",
            _keys("lr", "betas", "weight_decay", "cautious_weight_decay"),
            ("exp_avg",),
            _lion_update,
            summary="the sign of an interpolated momentum",
            source="Chen et al., arXiv 2302.06675",
        ),
    )
}
"""The scalar optimizers by name (the ``"rule"`` values of scalar groups): ``adamw``
and ``lion``, each a :class:`ScalarRule`."""

SCALAR_ALGORITHMS = tuple(SCALAR_RULES)
"""The ``"rule"`` values a scalar group (embeddings, head, norms, biases) may take:
AdamW (decoupled weight decay, Loshchilov & Hutter 2019) or Lion (Chen et al. 2023)."""


def get_scalar_rule(name: str) -> ScalarRule:
    """The scalar optimizer called ``name``.

    Raises:
        ValueError: unknown name; the message lists the scalar optimizers.

    Examples:
        >>> get_scalar_rule("lion").buffers
        ('exp_avg',)
    """
    try:
        return SCALAR_RULES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown scalar optimizer {name!r}; expected one of {list(SCALAR_RULES)}"
        ) from None


def scalar_state_shapes(algorithm: str, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """The state keys of one parameter under ``"rule"`` and their shapes (declared by
    its :class:`ScalarRule`).

    Examples:
        >>> import torch
        >>> scalar_state_shapes("lion", torch.zeros(2, 3))
        {'step': (), 'exp_avg': (2, 3)}
    """
    return get_scalar_rule(algorithm).state_shapes(param)
