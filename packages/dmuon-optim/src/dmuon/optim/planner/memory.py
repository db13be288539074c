"""Predicted memory per rank: weights, gradients, optimizer state, communication buffers.

For ``N`` ranks, ``e`` bytes per parameter element, ``Φ_M`` matrix and ``Φ_S``
scalar elements, ``O_r`` the matrix elements rank ``r`` owns and ``ℓ`` the elements
of the largest layer (the transient unsharded layer of FSDP2 and of the ZeRO-3-like
owner mode); the busiest rank (largest ``O_r``) is reported:

* ``adamw`` (FSDP2, ZeRO-3): weights ``Φe/N + 2ℓe``, gradients ``Φe/N + ℓe``,
  state ``8Φ/N`` (fp32 moments);
* ``vanilla`` (FSDP2 + Muon): as AdamW, state ``Φ_M e/N + 8Φ_S/N``, buffers the
  largest gathered gradient;
* ``owner`` (ZeRO-2-like): weights and gradients ``Φ_M e + Φ_S e/N``, state
  ``O_r e + 8Φ_S/N``, reduce buckets ``Φ_M e``;
* ``owner-z3`` (``reshard_after_forward``): weights ``O_r e + Φ_S e/N + 2ℓe``,
  gradients ``O_r e + Φ_S e/N + ℓe``, state ``O_r e + 8Φ_S/N``, reduce buckets
  ``Φ_M e`` at their peak: each layer's exists from its launch in backward until the
  step waits for its reduction, so at the end of backward every layer's does (none
  between steps, nor during the forward);
* ``replicated`` (DDP): weights and gradients ``Φe``, state ``O_r e + 8Φ_S``,
  DDP buckets ``Φe`` and the all-gather's ``ℓNe``;
* ``sharded`` (FSDP2): weights ``Φe/N + 2ℓe``, gradients ``Φe/N + ℓe``, state
  ``O_r e + 8Φ_S/N``, all-to-all buffers ``2ℓe``;
* ``sign``: weights and gradients ``Φe``, state ``Φ_M e + 8Φ_S``, the vote's buffers
  at their peak, ``max(12ℓ/5, 7ℓ/5 + 3ℓ/N)`` (counted from
  :func:`dmuon.comm.majority_vote`'s ``"packed"`` method: packing the signs takes an
  int8 sign and a digit per entry, ``2ℓ``, beside the packed votes sent and received,
  ``ℓ/5`` each; then the received votes unpacked as int8, ``ℓ``, and this rank's share
  of the positions summed, signed and packed in int8, ``3ℓ/N``).

The scalar parameters of owner mode (ZeRO-2-like) follow the integration
(``scalars=``): ``"sharded"`` (the above: ``fsdp.dedicate``, FSDP2 shards them),
``"all_reduce"`` (``ddp.dedicate``'s default: weights and gradients ``Φe`` on every
rank, every rank steps the scalars, state ``O_r e + 8Φ_S``, buckets ``Φe``) or
``"owner"`` (``ddp.dedicate(scalars="owner")``: the scalar tensors are planned with
the matrices, whole, so the plan must hold them by name; weights and gradients
``Φe``, state ``max_r (O_r e + 8 S_r)`` with ``S_r`` the scalar elements rank ``r``
owns, buckets ``Φe``).

With tensor parallelism (``T``) the spec is the one a rank holds (each split matrix
its ``⌈L/T⌉ × g`` shard, :class:`~dmuon.optim.planner.parallel.Layout`) and ``N`` the
``dp = N_gpus/T`` ranks: weights, gradients and state of split matrices divide by ``T``;
vanilla Muon's buffer is the largest *whole* split matrix, gathered over ``tp``. With
expert parallelism the spec holds ``E/E_p`` experts per stack (``x`` elements); the
FSDP2 modes shard them over their ``R = dp/E_p`` replicas (``x/R`` instead of
``x/N``), and a mode with owners keeps the momentum of the experts a rank owns
(``held``) beside ``O_r``.

The matrix rule's state is counted from the rule's declared state
(:meth:`~dmuon.optim.Rule.state_specs`): ``k_m`` tensors of the matrix's shape (the
momentum; AdaMuon's second moment) and ``k_r`` of one value per row (NorMuon's), in
``s`` bytes per element — the parameter's ``e`` by default (4 for a second moment of
fp16 parameters, which DMuon keeps in fp32), 4 or 2 with DMuon's
``state_dtype="float32"``/``"bfloat16"``. Above, ``O_r e`` of state stands for
``Σ (k_m·numel + k_r·rows)·s`` over the matrices rank ``r`` owns, and ``Φ_M e`` of
state for the same sum over every matrix. AdamW's scalar moments stay fp32 (8 bytes).

Owner mode (ZeRO-2-like) keeps every matrix on every rank: the owners broadcast
into the parameters, and backward produces every matrix's gradient locally before
it is reduced. Muon's momentum is a ``zeros_like`` of the parameter (same dtype),
held only by the owner. Activations are not modelled (they are the same in every
mode and depend on the micro-batch and checkpointing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmuon.comm import MatrixItem, OwnerPlan
from dmuon.optim.planner.config import ModelSpec
from dmuon.optim.rules import get_rule
from dmuon.optim.state_precision import state_dtype_of

SCALAR_LAYOUTS = ("sharded", "all_reduce", "owner")

__all__ = ["memory_per_rank"]


def _largest_layer(spec: ModelSpec) -> tuple[int, int]:
    """(elements of the largest layer's matrices, of the largest single matrix)."""
    by_layer: dict[str, int] = {}
    for i in spec.matrices:
        by_layer[str(i.layer)] = by_layer.get(str(i.layer), 0) + i.numel
    return max(by_layer.values(), default=0), max((i.numel for i in spec.matrices), default=0)


def memory_per_rank(
    spec: ModelSpec,
    plan: OwnerPlan,
    mode: str,
    *,
    held: list[int] | None = None,
    experts: int = 0,
    replicas: int = 1,
    gathered: int = 0,
    rule: str = "muon",
    state_dtype: str | None = None,
    scalars: str = "sharded",
) -> dict[str, float]:
    """Bytes per rank in ``mode``: ``weights``, ``gradients``, ``optimizer_state``,
    ``buffers`` and their ``total`` (activations excluded).

    Args:
        spec: the model as one rank holds it.
        plan: the owner plan over the data-parallel ranks.
        mode: the mode.
        held: per rank, the expert elements it steps outside the plan.
        experts: ``x``, the expert-stack elements a rank holds (expert parallelism).
        replicas: ``R``, the ranks holding the same experts.
        gathered: elements of the largest matrix vanilla Muon gathers whole (over tp).
        rule: DMuon's matrix rule, whose declared state is counted.
        state_dtype: the matrix state's dtype (``None``: the parameter's).
        scalars: owner mode's scalar parameters: ``"sharded"`` (``fsdp.dedicate``),
            ``"all_reduce"`` or ``"owner"`` (``ddp.dedicate``'s ``scalars=``; with
            ``"owner"`` the plan holds the scalar tensors by their names).

    Raises:
        ValueError: an unknown ``mode`` or ``scalars``, ``scalars`` other than
            ``"sharded"`` outside ``owner``, or ``"owner"`` with a plan
            that holds none of the model's scalar tensors.

    Examples:
        >>> from dmuon.comm import plan_owners
        >>> from dmuon.optim.planner.config import load_model
        >>> spec = load_model("gpt2")
        >>> m = memory_per_rank(spec, plan_owners(spec.matrices, 1), "replicated")
        >>> m["weights"] == spec.total_params * 2  # bf16
        True
    """
    if scalars not in SCALAR_LAYOUTS:
        raise ValueError(f"scalars must be one of {SCALAR_LAYOUTS}, got {scalars!r}")
    if scalars != "sharded" and mode != "owner":
        raise ValueError(
            f"scalars={scalars!r} is ddp.dedicate's owner mode ('owner'); {mode!r} shards them"
        )
    N = plan.world_size
    e = spec.matrices[0].dtype.itemsize if spec.matrices else 2
    phi, pm, ps = spec.total_params, spec.matrix_params, spec.scalar_params
    layer, biggest = _largest_layer(spec)
    biggest = max(biggest, gathered)
    extra = held or [0] * N
    owned = max(sum(i.numel for i in plan.items_of(r)) + extra[r] for r in range(N))
    specs = get_rule(rule).state_specs()
    param_dtype = spec.matrices[0].dtype if spec.matrices else torch.bfloat16
    group = {"state_dtype": state_dtype}
    # bytes per element of each buffer's dtype, summed over the buffers of each kind
    s_m = sum(state_dtype_of(group, param_dtype, x).itemsize for x in specs if x.kind == "matrix")
    s_r = sum(state_dtype_of(group, param_dtype, x).itemsize for x in specs if x.kind == "row")

    def state(items: Sequence[MatrixItem], held_elements: int = 0) -> float:
        """Bytes of the matrix rule's state for ``items`` (plus held expert elements)."""
        return sum(s_m * i.numel + s_r * i.batch * i.rows for i in items) + s_m * held_elements

    if scalars == "owner":  # the scalar tensors are in the plan: split them off
        names = {n for n, _ in spec.scalars}
        if names and not any(i.name in names for i in plan.items):
            raise ValueError(
                "scalars='owner' needs the plan of ddp.dedicate(scalars='owner'): the scalar "
                "tensors planned with the matrices (by name), and this plan holds none of them"
            )
        mats = [[i for i in plan.items_of(r) if i.name not in names] for r in range(N)]
        own_s = [sum(i.numel for i in plan.items_of(r) if i.name in names) for r in range(N)]
        owned_state = max(state(mats[r], extra[r]) + 8 * own_s[r] for r in range(N))
    else:
        owned_state = max(state(plan.items_of(r), extra[r]) for r in range(N))
    all_state = state(spec.matrices)

    def sh(v: int, k: float) -> float:
        """``v·k/N``, FSDP2's share, with the experts sharded over their replicas."""
        return v * k / N if not experts else ((v - experts) / N + experts / replicas) * k

    m: tuple[float, float, float, float]
    if mode == "adamw-ddp":
        m = (phi * e, phi * e, 8 * phi, phi * e)
    elif mode == "vanilla-ddp":
        m = (phi * e, phi * e, pm * e + 8 * ps, phi * e)
    elif mode == "adamw":
        m = (sh(phi, e) + 2 * layer * e, sh(phi, e) + layer * e, sh(phi, 8), 0.0)
    elif mode == "vanilla":
        m = (sh(phi, e) + 2 * layer * e, sh(phi, e) + layer * e, sh(pm, e) + 8 * ps / N,
             biggest * e)  # fmt: skip
    elif mode == "owner" and scalars != "sharded":
        # ddp.dedicate: every rank holds every weight and gradient; the owners' state
        # holds the owned scalars' 8 S_r, or every rank steps the all-reduced ones (8Φ_S)
        m = (phi * e, phi * e, owned_state + (8 * ps if scalars == "all_reduce" else 0), phi * e)
    elif mode == "owner":
        m = (pm * e + ps * e / N, pm * e + ps * e / N, owned_state + 8 * ps / N, pm * e)
    elif mode == "owner-z3":
        m = (owned * e + ps * e / N + 2 * layer * e, owned * e + ps * e / N + layer * e,
             owned_state + 8 * ps / N, pm * e)  # fmt: skip
    elif mode == "replicated":
        m = (phi * e, phi * e, owned_state + 8 * ps, phi * e + layer * N * e)
    elif mode == "sharded":
        m = (sh(phi, e) + 2 * layer * e, sh(phi, e) + layer * e, owned_state + 8 * ps / N,
             2 * layer * e)  # fmt: skip
    elif mode == "sign":
        m = (phi * e, phi * e, all_state + 8 * ps, layer * max(12 / 5, 7 / 5 + 3 / N))
    else:
        raise ValueError(f"unknown mode {mode!r}")
    keys = ("weights", "gradients", "optimizer_state", "buffers")
    out = {k: float(v) for k, v in zip(keys, m, strict=True)}
    out["total"] = sum(out.values())
    return out
