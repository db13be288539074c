"""Choosing the execution mode: explicit where it must be, detected where it is unambiguous.

=============  ==============================================================
``single``     no process group (or every rank deliberately does everything)
``owner``      parameters dedicated by ``dmuon.integrations`` (``distributed=``)
``replicated`` stock DDP: gradients already all-reduced
``sharded``    stock FSDP2: matrices are ``Shard(0)`` DTensors
``sign``       ``rule="sign_muon"``: local gradients, majority vote
=============  ==============================================================

Detection (``mode=None``): a dedication (``distributed=`` or dedicated
parameters) means ``owner``; DTensor matrices mean ``sharded``, and so do scalar
parameters sharded over a mesh dimension (FSDP2's) when no matrix is a plain tensor (a
model of norms and biases alone has no matrix to tell FSDP2 by; plain matrices beside
FSDP2's scalars may be ones kept out of ``fully_shard`` for a dedication, so they stay
ambiguous); no process group, or a group of one, means ``single``. Otherwise the
optimizer cannot know whether the gradients were averaged (DDP) or are local, and
guessing wrong is silently wrong — so it raises and asks for ``mode="replicated"``
(DDP averaged them), ``mode="sign"`` (local gradients), ``mode="single"`` (every rank
does all the work) or a ``dedicate()`` for owner mode. A process a launcher started as
one of several (``WORLD_SIZE`` > 1) without a process group is refused too, rather than
detected as ``single`` (every process would train alone); ``mode="single"`` said
outright is taken.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dmuon.comm.process_groups import check_launched, check_member, group_size
from dmuon.optim.engine.base import Engine, SingleEngine, Stepper
from dmuon.optim.engine.exchange import OwnerExchange, exchange_of
from dmuon.optim.engine.layer_packing import DEFAULT_PACK_MB, check_pack_mb
from dmuon.optim.engine.owner import OwnerEngine
from dmuon.optim.engine.params import collect_params, is_dtensor
from dmuon.optim.engine.placements import check_placements, sharded_scalars
from dmuon.optim.engine.replicated import ReplicatedEngine
from dmuon.optim.engine.sharded import ShardedEngine
from dmuon.optim.engine.sign import SignEngine
from dmuon.optim.engine.tensor_split import check_split_groups

__all__ = ["MODES", "check_layouts", "make_engine"]

MODES = ("single", "owner", "replicated", "sharded", "sign")
"""The execution modes of ``DMuon(mode=...)``, see the table above and the Concepts page
"Execution modes"."""


def _exchange(distributed: Any) -> OwnerExchange:
    if isinstance(distributed, OwnerExchange):
        return distributed
    ex = getattr(distributed, "exchange", None)
    if isinstance(ex, OwnerExchange):
        return ex
    raise TypeError(
        f"distributed= takes what dmuon.integrations.fsdp.dedicate / ddp.dedicate return "
        f"(or an OwnerExchange), got {type(distributed).__name__}"
    )


def make_engine(
    opt: Stepper,
    *,
    mode: str | None = None,
    distributed: Any = None,
    process_group: Any = None,
    pipeline_depth: int = 2,
    layer_pack_mb: float | None = None,
) -> Engine:
    """The engine for ``opt``: resolve the mode, plan, check every rank agrees, bind.

    Raises:
        ValueError: an unknown mode, a mode that contradicts the parameters (e.g.
            ``sharded`` without DTensors, or DTensor placements the mode does not step:
            :func:`~dmuon.optim.engine.placements.check_placements`), or a process group
            without a mode.
        dmuon.optim.engine.ModelMismatchError: the ranks' models differ.
    """
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} or None (detect), got {mode!r}")
    if (
        isinstance(pipeline_depth, bool)
        or not isinstance(pipeline_depth, int)
        or pipeline_depth < 1
    ):
        raise ValueError(f"pipeline_depth must be an int ≥ 1, got {pipeline_depth!r}")
    pack_mb = DEFAULT_PACK_MB if layer_pack_mb is None else layer_pack_mb
    check_pack_mb(pack_mb)
    check_member(process_group, "process_group")
    params = collect_params(opt.param_groups)
    exchange = _exchange(distributed) if distributed is not None else None
    dedicated = {exchange_of(e.param) for e in params} - {None}
    if exchange is None and len(dedicated) == 1:
        exchange = next(iter(dedicated))
    elif len(dedicated) > 1:
        raise ValueError("the parameters are dedicated by more than one dedicate() call")
    dtensors = [e.name for e in params if e.matrix and is_dtensor(e.param)]
    plain = [e.name for e in params if e.matrix and not is_dtensor(e.param)]
    fsdp_scalars = sharded_scalars(params)
    if mode is None:
        if exchange is not None:
            mode = "owner"
        elif dtensors or (fsdp_scalars and not plain):
            mode = "sharded"
        elif _world(process_group) > 1:
            hint = (
                f"; the scalar parameters are FSDP2's (e.g. {fsdp_scalars[0]!r}) but the "
                f"matrices are plain tensors (e.g. {plain[0]!r}): if you kept the matrices "
                "out of fully_shard, dedicate them (dmuon.integrations.fsdp.dedicate) and "
                "pass distributed= its result"
                if fsdp_scalars
                else ""
            )
            raise ValueError(
                f"a process group of {_world(process_group)} ranks is initialised, and DMuon "
                "cannot tell how the gradients arrive. Say mode='replicated' if DDP already "
                "averages them (DMuon then orthogonalises each matrix on one owner and "
                "all-gathers the results), mode='sign' for Sign-Muon on local gradients, "
                "mode='single' to have every rank do all the work, or use "
                "dmuon.integrations.fsdp.dedicate / ddp.dedicate for owner mode (then build "
                "DMuon after dedicate(), with distributed= its result: a dedication made "
                f"after the optimizer is not seen){hint}"
            )
        else:
            check_launched("DMuon(...)")  # torchrun without a process group: not single
            mode = "single"
    elif mode in ("replicated", "sign"):
        check_launched(f"DMuon(mode={mode!r})")
    if mode == "owner" and exchange is None:
        raise ValueError(
            "mode='owner' needs dedicated parameters: call dmuon.integrations.fsdp.dedicate "
            "(or ddp.dedicate) and pass its result as distributed="
        )
    if mode == "owner" and layer_pack_mb is not None:
        raise ValueError(
            f"layer_pack_mb={layer_pack_mb!r} was given to DMuon in owner mode, whose layers "
            "are packed by the dedication: pass it to dedicate(..., layer_pack_mb=) instead"
        )
    if mode != "owner" and exchange is not None:
        raise ValueError(
            f"the parameters are dedicated to owners, which is owner mode, but mode={mode!r} "
            "was asked for; drop mode= (or the dedicate() call)"
        )
    check_layouts(opt.param_groups, mode, exchange.group if exchange else process_group)
    engine: Engine
    if mode == "single":
        engine = SingleEngine()
    elif mode == "owner":
        assert exchange is not None
        engine = OwnerEngine(exchange)
    elif mode == "replicated":
        engine = ReplicatedEngine(
            process_group, pipeline_depth=pipeline_depth, layer_pack_mb=pack_mb
        )
    elif mode == "sharded":
        engine = ShardedEngine(process_group, pipeline_depth=pipeline_depth, layer_pack_mb=pack_mb)
    elif mode == "sign":
        engine = SignEngine(process_group, pipeline_depth=pipeline_depth, layer_pack_mb=pack_mb)
    else:  # MODES is checked before; a mode added there must be given its engine here
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    engine.bind(opt)
    return engine


def check_layouts(param_groups: list[dict[str, Any]], mode: str, process_group: Any = None) -> None:
    """Refuse a matrix whose DTensor layout ``mode`` does not step, or in ``sign`` mode a
    scalar parameter that is a DTensor
    (:func:`~dmuon.optim.engine.placements.check_placements`), or, in ``replicated``
    and ``owner`` mode, a split that crosses ``process_group``, the group it plans owners
    over (owner mode: the dedication's)
    (:func:`~dmuon.optim.engine.tensor_split.check_split_groups`).

    Every rank reads the same placements, so every rank refuses alike, before any
    collective: none is left waiting.
    """
    params = collect_params(param_groups)
    check_placements(params, mode)
    if mode in ("replicated", "owner"):
        check_split_groups(params, process_group, mode)


def _world(group: Any) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return group_size(group)
