"""A complete optimizer state dict from every rank's share, for one-file checkpoints.

In ``replicated`` mode (stock DDP, and so the Hugging Face Trainer under
torchrun) each rank keeps the momentum of the matrices it owns only; the other
ranks hold empty placeholders under the same keys. A checkpoint written by one
process — the Trainer saves ``optimizer.pt`` from the main process only — would
lose every other owner's momentum, and a resumed run would silently restart it
from zero. :func:`gather_full_state_dict` is a collective: every rank calls it,
each owner broadcasts its state, and every rank gets the full state dict (the
format of :meth:`dmuon.optim.DMuon.state_dict`, with no placeholders left).
It holds no placeholder, so it loads on any number of ranks (any owner plan) and on
one process: :meth:`~dmuon.optim.DMuon.load_state_dict` keeps what each rank steps
and drops the rest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dmuon.comm import wait_work
from dmuon.integrations.checkpoint.deadline import checkpoint_deadline
from dmuon.optim import DMuon, get_rule
from dmuon.optim.engine import PlannedEngine
from dmuon.optim.optimizer_state import expected_state_shapes
from dmuon.optim.state_precision import state_dtype_of

__all__ = ["gather_full_state_dict", "missing_state", "unwrap_optimizer"]

# Modes whose state dicts this module completes. ``single`` holds everything on every
# rank already; ``sign`` keeps a different momentum on every rank (no single file can
# hold it); ``owner``/``sharded`` go through dmuon.integrations.checkpoint (DCP).
_GATHERED_MODES = ("single", "replicated")


def unwrap_optimizer(optimizer: Any) -> DMuon:
    """The :class:`~dmuon.optim.DMuon` inside wrappers such as accelerate's
    ``AcceleratedOptimizer`` (anything with an ``.optimizer`` attribute).

    Raises:
        TypeError: no DMuon inside.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> opt = DMuon([torch.nn.Parameter(torch.zeros(4, 4))])
        >>> unwrap_optimizer(opt) is opt
        True
    """
    seen = 0
    inner = optimizer
    while not isinstance(inner, DMuon) and hasattr(inner, "optimizer") and seen < 8:
        inner, seen = inner.optimizer, seen + 1
    if not isinstance(inner, DMuon):
        raise TypeError(
            f"expected a dmuon.optim.DMuon (or a wrapper with .optimizer around one), got "
            f"{type(optimizer).__name__}"
        )
    return inner


def missing_state(state_dict: dict[str, Any]) -> list[str]:
    """The state entries of ``state_dict`` that are placeholders (another rank's share).

    Returns ``"<parameter name or index>/<key>"`` strings; empty for a complete state
    dict. The check reads the dict only, so every rank that reads the same file
    reaches the same verdict without communicating.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> opt = DMuon([torch.nn.Parameter(torch.zeros(4, 4))])
        >>> missing_state(opt.state_dict())
        []
    """
    names: dict[int, str] = {}
    for g in state_dict.get("param_groups", []):
        for i, idx in enumerate(g.get("params", [])):
            pn = g.get("param_names")
            names[idx] = pn[i] if pn is not None and i < len(pn) else str(idx)
    out = []
    for idx, st in state_dict.get("state", {}).items():
        for key, value in st.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.numel() == 0:
                out.append(f"{names.get(idx, idx)}/{key}")
    return out


def gather_full_state_dict(optimizer: Any) -> dict[str, Any]:
    """Every rank's share of the optimizer state, on every rank (a collective).

    Call it on every rank of the optimizer's process group. For each owner rank and
    dtype, the owner's state tensors travel in one flat broadcast. In ``single``
    mode (or on one rank) it is ``optimizer.state_dict()``.

    Args:
        optimizer: a :class:`~dmuon.optim.DMuon`, or a wrapper around one.

    Returns:
        ``optimizer.state_dict()`` with every placeholder replaced by its owner's
        values (:func:`missing_state` of it is empty).

    Raises:
        TypeError: not a DMuon.
        ValueError: a mode whose state no single file can hold this way (``sign``:
            every rank has its own momentum; ``owner``/``sharded``: use DCP through
            ``dmuon.integrations.checkpoint``). Raised on every rank alike (the mode
            is the same on every rank).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> opt = DMuon([torch.nn.Parameter(torch.zeros(4, 4))])
        >>> sd = gather_full_state_dict(opt)  # one process: the state dict itself
        >>> missing_state(sd), sorted(sd["state"][0])
        ([], ['momentum_buffer', 'step'])
    """
    opt = unwrap_optimizer(optimizer)
    engine = opt.engine
    if engine.mode not in _GATHERED_MODES:
        raise ValueError(
            f"gather_full_state_dict supports modes {_GATHERED_MODES}, but the optimizer runs "
            f"mode {engine.mode!r}; "
            + (
                "Sign-Muon keeps a different momentum on every rank, so save one file per rank"
                if engine.mode == "sign"
                else "save owner/sharded state with torch.distributed.checkpoint"
            )
        )
    sd = opt.state_dict()
    # torch's state_dict() hands out the optimizer's own per-parameter dicts: copy them
    # before replacing entries, or the live state would change.
    sd["state"] = {idx: dict(st) for idx, st in sd["state"].items()}
    if engine.world_size == 1 or not isinstance(engine, PlannedEngine):
        return sd
    # Walk the parameters in the state dict's numbering (sequential over the groups).
    pending: dict[tuple[int, torch.dtype], list[tuple[dict[str, Any], str, torch.Tensor]]] = {}
    index = 0
    for gi, group in enumerate(opt.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            idx, index = index, index + 1
            owner = engine.owner_of(p)
            if owner is None or idx not in sd["state"]:
                continue  # stepped on every rank alike (AdamW on all-reduced gradients)
            name = names[i] if names is not None and i < len(names) else f"group{gi}.param{i}"
            # a tensor-parallel matrix: this rank's shard of the state (the owner's tp row
            # holds it shard by shard; the broadcast runs over this tp column's dp group)
            shapes = expected_state_shapes(group, p, name, engine.on_shard, engine.split_of)
            st = sd["state"][idx]
            specs = {s.name: s for s in get_rule(group["rule"]).state_specs()}
            for key in sorted(shapes):
                # the state's own dtype (bf16 with state_dtype="bfloat16"; fp32 for a second
                # moment of fp16 weights), not the weight's
                dtype = (
                    torch.float32
                    if key == "step"
                    else state_dtype_of(group, p.dtype, specs.get(key))
                )
                if owner == engine.rank:
                    # on the parameter's device: a step counter may live on the host
                    value = st[key].detach().to(p.device, dtype).reshape(shapes[key])
                else:
                    value = torch.empty(shapes[key], dtype=dtype, device=p.device)
                pending.setdefault((owner, dtype), []).append((st, key, value))
    with checkpoint_deadline(opt, "DMuon state gather (gather_full_state_dict)"):
        for (owner, _dtype), entries in pending.items():
            flat = torch.cat([v.reshape(-1) for _, _, v in entries])
            work = dist.broadcast(flat, group=engine.group, group_src=owner, async_op=True)
            wait_work(work, f"broadcast of rank {owner}'s optimizer state", engine.group)
            offset = 0
            for st, key, value in entries:
                n = value.numel()
                st[key] = flat[offset : offset + n].view(value.shape).clone()
                offset += n
    return sd
