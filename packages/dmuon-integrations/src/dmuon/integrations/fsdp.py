"""DMuon with FSDP2: dedicate the matrices to owners, let ``fully_shard`` take the rest.

The three-line change to an FSDP2 script::

    ded = dedicate(model, mesh)                                   # 1
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)  # 2
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), lr=1e-3, distributed=ded)    # 3

FSDP2 shards and synchronises the embeddings, head, norms and biases as usual
(they take AdamW inside DMuon); each dedicated matrix is whole on its owner, its
gradient is reduced to the owner from a hook per layer during backward, the owner
steps it, and the new weight is broadcast back and waited in that layer's next
forward. No FSDP2 internals are touched: ``ignored_params`` is its public way to
leave parameters alone.

Precision: FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` casts only the parameters
FSDP2 manages, so the dedicated matrices keep their own dtype while the activations
around them arrive in ``param_dtype``. A forward without ``torch.autocast`` under such a
policy is refused, on every rank; ``reduce_dtype`` and ``output_dtype``
alone, or the policy under ``torch.autocast``, train as in stock FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import CommStats, layer_key
from dmuon.integrations.dedication import Dedication, build_dedication
from dmuon.integrations.selection import Predicate
from dmuon.optim.engine import DEFAULT_PACK_MB

__all__ = ["dedicate"]


def dedicate(
    model: nn.Module,
    mesh: Any = None,
    *,
    predicate: Predicate | None = None,
    reshard_after_forward: bool = False,
    reduce_op: str = "avg",
    free_local_grads: bool = False,
    strategy: str = "lpt",
    layer_of: Callable[[str], str] = layer_key,
    layer_pack_mb: float = DEFAULT_PACK_MB,
    stats: CommStats | None = None,
    **plan_options: Any,
) -> Dedication:
    """Give every matrix of ``model`` an owner rank and install DMuon's hooks (FSDP2).

    Call it on every rank, after the model is on its device and before
    ``fully_shard``; pass ``ded.params`` to ``fully_shard(..., ignored_params=...)``.

    It plans owners with :func:`dmuon.comm.plan_owners` (by Newton–Schulz cost;
    same-layer matrices on different ranks), checks that every rank built the same
    model (a mismatch raises on every rank, naming the parameter, before any other
    collective), gives every rank rank 0's dedicated weights (``fully_shard`` takes the
    others from each rank's own copy), and hooks the model:
    gradient reduction to owners per layer from post-accumulate-grad hooks, and a
    forward pre-hook per layer that waits for the layer's published weights. A forward
    pre-hook on ``model`` refuses, at each forward, an FSDP2 ``param_dtype`` cast that
    cannot reach the dedicated matrices, outside ``torch.autocast`` (guide: FSDP2,
    Precision).

    Args:
        model: the model (the same on every rank).
        mesh: a 1-D ``DeviceMesh`` (FSDP), a 2-D one (HSDP: replicate × shard), a
            ``ProcessGroup``, or ``None`` (the world). A 2-D ``dp × tp`` mesh of a model
            parallelised with ``parallelize_module`` on one of its dimensions is not
            HSDP: owners are planned over the other one (the rule:
            :func:`~dmuon.integrations.selection.tensor_parallel_dim`) and each owner's
            ``tp`` row steps the shards (:mod:`dmuon.optim.engine.owner_split`); shard
            the rest with ``fully_shard(model, mesh=mesh["dp"], ignored_params=...)``.
        predicate: ``(name, param) → bool`` choosing the dedicated parameters;
            default the matrices of :func:`dmuon.optim.param_groups` (hidden weights,
            conv weights, expert stacks).
        reshard_after_forward: ZeRO-3-like: a rank keeps only the matrices it owns
            and the others are broadcast around each layer's forward and backward
            (3(N−1)/N·P bytes per step instead of 2(N−1)/N·P); default ZeRO-2-like,
            every matrix resident. 1-D meshes of plain tensors only. Every rank must
            run every dedicated layer: the end of each training forward of ``model``
            itself checks it (:class:`~dmuon.integrations.PartialUseError` on every
            rank otherwise; a loop that calls only its submodules, as a Lightning
            ``training_step`` may, goes unchecked).
        reduce_op: how the dedicated gradients are combined over the ranks, to match
            FSDP2's for the rest: ``"avg"`` (FSDP2's default: the mean) or ``"sum"``
            (after ``set_gradient_divide_factor(1.0)`` on the FSDP2 modules, as
            torchtitan does because it divides the loss by the global token count).
        free_local_grads: set a dedicated matrix's local ``p.grad`` to ``None`` once it
            is copied for its reduction, as FSDP2 frees the unsharded gradients: less
            memory in backward, and no plain-tensor gradient beside FSDP2's DTensor ones
            when a trainer takes the norm of every ``p.grad`` itself (torchtitan). The
            same for an expert stack replicated over ``dp`` (``dp × ep``) once it is
            copied for its reduction to its owner among the replicas (a stack on ``ep``
            alone keeps its gradient: it is final). The owners' reduced gradients are set
            in ``step()`` as always.
        strategy: owner planning strategy (``"lpt"`` or ``"ilp"``; see
            :func:`dmuon.comm.plan_owners`).
        layer_of: name → layer key; a layer is the unit of reduction, publication and
            pipelining (default :func:`dmuon.comm.layer_key`: ``blocks.3``).
        layer_pack_mb: consecutive layers whose parameters hold at most this many MiB
            together are reduced and published as one unit (one collective per owner and
            pack, not per owner and layer: on a model of many small layers the
            collectives' latency bounds the step); default 1 MiB (DDP's first bucket),
            ``0``: every layer alone. Ignored (layers alone) with
            ``reshard_after_forward`` or tensor-parallel parameters.
        stats: where bytes are recorded (default :func:`dmuon.comm.default_stats`).
        **plan_options: more arguments of :func:`dmuon.comm.plan_owners`.

    Returns:
        The :class:`~dmuon.integrations.Dedication`.

    Raises:
        ValueError: a bad mesh, a ``reduce_op`` other than ``"avg"``/``"sum"``, or no
            parameter to dedicate; at a forward of ``model`` outside ``torch.autocast``,
            an FSDP2 ``MixedPrecisionPolicy`` whose ``param_dtype`` differs from the
            dedicated matrices' dtype: FSDP2's cast does not reach them (the error names
            the policy and a matrix; use ``torch.autocast`` or no ``param_dtype``).
        TypeError: ``model`` not an ``nn.Module`` (``dedicate(model.parameters())``),
            ``predicate``/``layer_of`` not callable, ``layer_of`` returning something
            other than a str, ``stats`` neither ``None`` nor a ``CommStats``.
        RuntimeError: a process ``torchrun`` started (``WORLD_SIZE`` > 1) that has not
            called ``init_process_group``.
        dmuon.optim.ModelMismatchError: the ranks' models differ.

    Examples:
        >>> import torch
        >>> from dmuon.integrations.fsdp import dedicate
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        >>> ded = dedicate(model)  # one process: the world of one rank owns everything
        >>> sorted(ded.params, key=lambda p: p.shape) == sorted(
        ...     [model[1].weight, model[0].weight], key=lambda p: p.shape)
        True
    """
    ded = build_dedication(
        model,
        mesh,
        predicate=predicate,
        strategy=strategy,
        layer_of=layer_of,
        layer_pack_mb=layer_pack_mb,
        stats=stats,
        reshard_after_forward=reshard_after_forward,
        reduce_op=reduce_op,
        free_local_grads=free_local_grads,
        all_reduce_rest=False,
        kind="fsdp",
        plan_options=plan_options,
        experts_in_place=True,
        check_rest_use=True,  # FSDP2 synchronises the rest (partial_use.py)
    )
    ded.add_hooks(lambda: _install_precision_check(ded))
    return ded


def _policy_of(module: Any) -> Any:
    """The ``MixedPrecisionPolicy`` that ``fully_shard`` gave ``module``, or ``None``.

    torch (2.13) keeps it in the module's FSDP state only (``FSDPModule`` has setters but
    no public getter for it), so it is read there, and ``None`` when a torch version
    stores it elsewhere: the check then stays silent, as before it existed.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    try:
        return getattr(get_state(), "_mp_policy", None)
    except Exception:  # an unreadable policy is not a refusal
        return None


def _describe(policy: Any) -> str:
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    return (
        "MixedPrecisionPolicy(" + ", ".join(f"{f}={getattr(policy, f, None)}" for f in fields) + ")"
    )


def _own_parameters(unit: Any, fsdp_module: type) -> list[nn.Parameter]:
    """The parameters of ``unit``'s modules, not those of a nested ``fully_shard`` unit
    (whose own policy applies to them)."""
    out: list[nn.Parameter] = []
    stack: list[nn.Module] = [unit]
    while stack:
        module = stack.pop()
        out.extend(module.parameters(recurse=False))
        stack.extend(c for c in module.children() if not isinstance(c, fsdp_module))
    return out


def _cast_conflicts(ded: Dedication) -> tuple[bool, list[tuple[str, Any, str, Any]]]:
    """Whether the model has FSDP2 modules yet, and each ``(unit, policy, name, matrix)``
    whose policy's ``param_dtype`` differs from the dtype of a dedicated matrix of that
    unit (the first such matrix per unit; a matrix belongs to the innermost unit around
    it, whose forward casts its inputs)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False, []
    model = ded.model
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    dedicated = {id(p) for p in ded.params}
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for where, unit in units:
        policy = _policy_of(unit)
        dtype = getattr(policy, "param_dtype", None)
        if dtype is None:
            continue
        mine = [
            p
            for p in _own_parameters(unit, FSDPModule)
            if id(p) in dedicated and p.is_floating_point() and p.dtype != dtype
        ]
        if mine:
            out.append((where, policy, names.get(id(mine[0]), "?"), mine[0]))
    return bool(units), out


class _PrecisionCheck:
    """Refuse an FSDP2 ``param_dtype`` cast the dedicated matrices cannot follow.

    ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))``
    casts the parameters FSDP2 manages (and, by default, each unit's inputs) to
    ``param_dtype``; the dedicated matrices are ``ignored_params``, outside FSDP2, so they
    keep their own dtype (fp32) and their layers meet ``param_dtype`` activations: torch's
    matmul then fails with a dtype mismatch that names neither the parameter nor the cause.
    ``dedicate`` cannot refuse the policy itself: the documented order shards after it,
    and under ``torch.autocast`` the same policy works (autocast casts the dedicated
    weights too). So a forward pre-hook on the dedication's model, first among its hooks,
    checks each forward; it reads only the policies, autocast's state and the dtypes,
    which every rank has alike, so every rank raises alike, before any of DMuon's
    collectives of that forward.

    The policies are read at the first forward that finds FSDP2 modules in the model
    (they do not change afterwards); autocast's state at every forward.
    """

    def __init__(self, ded: Dedication) -> None:
        self.ded = ded
        self.conflicts: list[tuple[str, Any, str, Any]] | None = None

    def __call__(self, _module: nn.Module, _args: Any) -> None:
        if self.conflicts is None:
            sharded, conflicts = _cast_conflicts(self.ded)
            if not sharded:
                return  # not under fully_shard yet: look again at the next forward
            self.conflicts = conflicts
        for where, policy, pname, p in self.conflicts:
            if torch.is_autocast_enabled(p.device.type):
                continue
            unit = f"fully_shard unit {where!r}" if where else "the model's fully_shard"
            raise ValueError(
                f"{unit} has {_describe(policy)}, but the dedicated parameter {pname!r} is "
                f"{p.dtype}: the dedicated matrices are left out of FSDP2 (ignored_params), "
                "so its cast to param_dtype does not reach them and their layers would meet "
                f"{policy.param_dtype} activations against {p.dtype} weights. Supported: run "
                f"the forward under torch.autocast({p.device.type!r}, "
                f"dtype={policy.param_dtype}) (the policy may stay: autocast casts the "
                "dedicated weights too), or call fully_shard without param_dtype "
                "(reduce_dtype/output_dtype alone are fine) "
                "(dmuon.integrations.fsdp.dedicate)"
            )


def _install_precision_check(ded: Dedication) -> list[RemovableHandle]:
    """The forward pre-hook of :class:`_PrecisionCheck`, first among the model's."""
    return [ded.model.register_forward_pre_hook(_PrecisionCheck(ded), prepend=True)]
