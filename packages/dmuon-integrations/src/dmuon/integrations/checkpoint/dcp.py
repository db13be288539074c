"""``save`` / ``load``: model and DMuon state through ``torch.distributed.checkpoint``.

One DCP checkpoint (a directory) holds::

    {"model": {fqn: tensor},                   # get_model_state_dict: FSDP2 DTensors, plain tensors
     "optim": {"state": {fqn: {key: tensor}},  # see sharded_state: owners' state once, as Shard(0)
               "param_groups": [...]},
     "dmuon": "<json: mode, world size, plan digest at save time>",
     "extra": b"..."}                           # what the caller passed (step, scheduler, ...),
                                                # torch.save'd whole: rank 0's

Saving is collective over every rank of the job; loading is collective over the
ranks of the new job, whatever their number: DCP reads each rank's tensors from
the saved pieces (resharding), the new plan's owners read their matrices' state
whole, and FSDP2 shards read their rows. A checkpoint is complete when its
``.metadata`` file exists (DCP writes it last), which :func:`load` checks.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from dmuon.comm.faults import wait_work
from dmuon.comm.flags import flag_device
from dmuon.comm.objects import broadcast_payload
from dmuon.integrations.checkpoint.compat import (
    CheckpointMismatchError,
    CheckpointReadError,
    check_compatible,
    load_into_optimizer,
)
from dmuon.integrations.checkpoint.deadline import checkpoint_deadline
from dmuon.integrations.checkpoint.holders import holdings, release, settle
from dmuon.integrations.checkpoint.owned_split import to_owners
from dmuon.integrations.checkpoint.sharded_state import state_targets, state_to_save
from dmuon.optim import DMuon

__all__ = ["check", "load", "save"]

FORMAT = 1


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process: that is the intent.
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message=".*single process.*")
        yield


def describe_optimizer(optimizer: DMuon, save_id: str | None = None) -> str:
    """What a checkpoint records about ``optimizer`` (format, mode, world, plan), as JSON;
    :func:`save` adds a ``save_id`` that :func:`load` checks every rank read alike."""
    info = optimizer.engine.describe()
    described = {
        "format": FORMAT,
        "mode": info["mode"],
        "world_size": info["world_size"],
        "plan_digest": info.get("plan_digest"),
    }
    if save_id is not None:
        described["save_id"] = save_id
    return json.dumps(described)


def _check_one_checkpoint(path: str, described: str, optimizer: DMuon) -> None:
    """Refuse, on every rank, a load whose ranks read different checkpoints (each its own
    ``path``: a filesystem that is not shared alike, a "latest" picked per rank): one
    all-reduce of the save's id, under the optimizer's deadline. Checkpoints without an
    id (saved before it existed) count as one."""
    save_id = str(json.loads(described).get("save_id", "")) if described else ""
    if not _same_on_every_rank(
        save_id.encode(), optimizer, "DMuon checkpoint load", "the checkpoint's save id"
    ):
        raise CheckpointMismatchError(
            [
                f"the ranks read different checkpoints: rank {dist.get_rank()} read {path!r} "
                f"(save {save_id[:12] or 'without an id'}), another rank another save. Give "
                "every rank the same checkpoint directory (pick it on rank 0 and broadcast "
                "it, on a filesystem every rank sees alike)"
            ]
        )


@torch.no_grad()
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: DMuon,
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Save ``model`` and ``optimizer`` as a DCP checkpoint in directory ``path``.

    Call it on every rank at the same point (between steps). Each owner-held state
    tensor is written once, in row pieces from every rank; FSDP2's shards as they
    are; the rest once. It does not change the model or the optimizer.

    Args:
        path: the checkpoint directory (created; use a fresh one per checkpoint).
        model: the model the optimizer was built on (FSDP2-sharded or plain).
        optimizer: the :class:`~dmuon.optim.DMuon`.
        extra: values to keep with the checkpoint (the step, a scheduler's
            ``state_dict()``, the CPU RNG state of a generator seeded alike on every
            rank), kept whole as ``torch.save`` keeps them (any keys, lists and
            tensors); :func:`load` returns them on every rank. One value for the job:
            rank 0's is saved, and a rank whose ``extra`` differs from rank 0's (a
            per-rank RNG state) warns, naming the keys, since it would get rank 0's
            back. Keep per-rank values in files of your own per rank.

    Raises:
        TypeError: ``optimizer`` is not a DMuon.
        ValueError: a parameter of the optimizer is not in ``model``, or a mode
            without one optimizer state (``sign``).

    Examples:
        >>> import tempfile, torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> from dmuon.integrations import checkpoint
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = DMuon(param_groups(model))
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step()
        >>> path = tempfile.mkdtemp()
        >>> checkpoint.save(path, model, opt, extra={"step": 1})
        >>> checkpoint.load(path, model, opt)
        {'step': 1}
    """
    held = holdings(model, optimizer)
    settle(optimizer)
    try:
        state: dict[str, Any] = {
            "model": get_model_state_dict(model),
            "optim": state_to_save(optimizer, held),
            "dmuon": describe_optimizer(optimizer, save_id=uuid.uuid4().hex),
        }
        # on every rank, whether it passed extra or not (rank 0's is kept): the digest's
        # all-reduce is a collective
        state["extra"] = _extra_bytes(extra or {}, optimizer)
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=os.fspath(path))
    finally:
        release(optimizer)


def _same_on_every_rank(blob: bytes, optimizer: DMuon, phase: str, what: str) -> bool:
    """Whether every rank holds the same ``blob``: one all-reduce (max) of its digest and
    of its negation, under the optimizer's deadline (``phase`` for the roll call). True
    without a process group of two ranks or more."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    digest = _digest(blob)
    flags = torch.tensor([digest, -digest], dtype=torch.int64, device=flag_device(None))
    with checkpoint_deadline(optimizer, phase):
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        wait_work(work, f"all-reduce of the digest of {what}")
    return flags.tolist() == [digest, -digest]  # the largest digest and the smallest


def _extra_bytes(extra: Mapping[str, Any], optimizer: DMuon) -> bytes:
    """``extra`` as ``torch.save`` writes it, rank 0's on every rank: one opaque value, so
    DCP neither flattens it (dotted keys, lists, digit keys came back reshaped) nor keeps
    an arbitrary rank's. One all-reduce of a digest finds out whether the ranks' values
    differ; if they do, rank 0's is broadcast and each other rank warns, naming its keys
    that differ from rank 0's (a rank that passed none takes rank 0's silently). Under
    the optimizer's deadline."""
    extra = _on_host(dict(extra))  # a CUDA tensor would come back on cuda:0 on every rank
    blob = _saved(extra)
    phase = "DMuon checkpoint save"
    if _same_on_every_rank(blob, optimizer, phase, "checkpoint.save's extra"):
        return blob
    with checkpoint_deadline(optimizer, phase):
        kept = broadcast_payload(blob, None, "broadcast of rank 0's extra").numpy().tobytes()
    if dist.get_rank() == 0 or not extra:  # a rank that passed none takes rank 0's
        return kept
    theirs = _extra_from(kept)
    differ = sorted(
        str(k)
        for k in set(extra) | set(theirs)
        if k not in extra or k not in theirs or _saved(extra[k]) != _saved(theirs[k])
    )
    warnings.warn(
        f"checkpoint.save: extra{differ} on rank {dist.get_rank()} differs from rank 0's; the "
        "checkpoint keeps rank 0's, which load() returns on every rank. Keep per-rank values "
        "(a generator seeded by rank) in files of your own per rank",
        RuntimeWarning,
        stacklevel=3,
    )
    return kept


def _digest(blob: bytes) -> int:
    """60 bits of the SHA-256 of ``blob``, an int64 every rank can compare by all-reduce."""
    return int(hashlib.sha256(blob).hexdigest()[:15], 16)


def _saved(value: Any) -> bytes:
    """``value`` as ``torch.save`` writes it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _extra_from(blob: bytes) -> dict[str, Any]:
    return dict(torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False))


def _on_host(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists and tuples) on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):  # a copy keeps its type (defaultdict's factory, order)
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _on_host(v)
        return out
    if isinstance(value, list):
        return [_on_host(v) for v in value]
    if isinstance(value, tuple):
        items = [_on_host(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _old_extra(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """Targets for ``extra`` as checkpoints before the one-value form stored it (flattened
    by DCP under ``extra.<key>``), or ``None`` when there is none: nested dicts and lists
    with a placeholder per leaf (a tensor of the saved size and dtype)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tree = _listify(_tree_from(metadata, "extra"))
    if not tree:
        return None
    for key, md in metadata.items():
        if key.startswith("extra.") and isinstance(md, TensorStorageMetadata):
            node = tree
            parts = key.split(".")[1:]
            for part in parts[:-1]:
                node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
            last = parts[-1]
            empty = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            if isinstance(node, list):
                node[int(last)] = empty
            else:
                node[last] = empty
    return dict(tree) if isinstance(tree, dict) else None


def _read_metadata(path: str) -> Any:
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"{path!r} holds no complete DCP checkpoint (no .metadata file: the save did not "
            "finish, or this is not a checkpoint directory)"
        )
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # unpickling garbage: name the file
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        where = os.path.join(path, ".metadata")
        raise CheckpointReadError(path, [rank], f"{where}: {type(err).__name__}: {err}") from err


def _dcp_load(state: dict[str, Any], path: str) -> None:
    """``dcp.load`` into ``state``; a file that fails to read raises
    :class:`CheckpointReadError` (DCP's ``CheckpointException`` is a ``BaseException``,
    which ``except Exception`` misses)."""
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:
        detail = "; ".join(
            f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(err.failures.items())
        )
        raise CheckpointReadError(path, sorted(err.failures), detail) from err


def _read_metadata_everywhere(path: str, optimizer: DMuon) -> Any:
    """:func:`_read_metadata` on every rank, agreed before DCP's first collective: a rank
    that cannot read it (a node-local copy, a shared file system that has not caught up,
    a corrupt file) raises its own error, and the others raise naming it, instead of
    waiting in DCP's collective for the process group's timeout. One all-reduce of a
    flag per rank, under the optimizer's deadline."""
    failed: Exception | None = None
    try:
        metadata = _read_metadata(path)
    except Exception as err:  # every rank must reach the agreement below
        failed, metadata = err, None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=flag_device(None))
        flags[dist.get_rank()] = int(failed is not None)
        with checkpoint_deadline(optimizer, "DMuon checkpoint load"):
            work = dist.all_reduce(flags, async_op=True)
            wait_work(work, "all-reduce of the checkpoint's metadata flags")
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
        if ranks and failed is None:
            raise FileNotFoundError(
                f"rank(s) {ranks} could not read {os.path.join(path, '.metadata')!r} (not on "
                "their file system, or it has not caught up there, or a corrupt file), this "
                "rank could; nothing was changed. Load from a directory every rank sees"
            )
    if failed is not None:
        raise failed
    return metadata


def _tree_from(keys: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Targets for the leaves under ``prefix`` (``a.0.b`` → nested dicts/lists): ``None``
    for a non-tensor, an empty tensor of the saved size and dtype for a tensor (a group's
    ``lr`` given as a tensor, which the group keeps)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: dict[str, Any] = {}
    for key, meta in keys.items():
        if not key.startswith(prefix + "."):
            continue
        parts = key[len(prefix) + 1 :].split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = (
            torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            if isinstance(meta, TensorStorageMetadata)
            else None
        )
    return root


def _listify(node: Any) -> Any:
    """Nested dicts whose keys are 0..n-1 become lists (DCP flattens lists by index)."""
    if not isinstance(node, dict):
        return node
    items = {k: _listify(v) for k, v in node.items()}
    if (
        items
        and all(k.isdigit() for k in items)
        and sorted(map(int, items)) == list(range(len(items)))
    ):
        return [items[str(i)] for i in range(len(items))]
    return items


def _read_checked(
    path: str, model: nn.Module, optimizer: DMuon
) -> tuple[list[Any], list[dict[str, Any]], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Phase 1 of :func:`load`: the small entries (groups, extra), then every check.

    Between :func:`settle` and :func:`release` (the model's state dict is read).
    Returns the holdings, the saved groups, the small entries, the model's state dict
    and the dtype of every saved tensor (by flat key).
    """
    held = holdings(model, optimizer)
    metadata = _read_metadata_everywhere(path, optimizer).state_dict_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved_shapes = {
        k: (tuple(v.size) if isinstance(v, TensorStorageMetadata) else None)
        for k, v in metadata.items()
    }
    small: dict[str, Any] = {
        "optim": {"param_groups": _listify(_tree_from(metadata, "optim.param_groups"))},
        "dmuon": "",
    }
    if "extra" in metadata:  # one torch.save'd value (bytes)
        small["extra"] = b""
    elif (old_extra := _old_extra(metadata)) is not None:  # a checkpoint of before
        small["extra"] = old_extra
    groups = small["optim"]["param_groups"]
    if not isinstance(groups, list):
        raise CheckpointMismatchError(
            [f"{path!r} has no optimizer param groups ('optim.param_groups')"]
        )
    if "dmuon" not in metadata:
        del small["dmuon"]
    _dcp_load(small, path)
    _check_one_checkpoint(path, small.get("dmuon", ""), optimizer)
    model_sd: dict[str, Any] = get_model_state_dict(model)
    model_shapes = {k: tuple(v.shape) for k, v in model_sd.items()}
    check_compatible(held, optimizer, model_shapes, saved_shapes, groups)
    saved_dtypes = {
        k: v.properties.dtype for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)
    }
    return held, groups, small, model_sd, saved_dtypes


@torch.no_grad()
def check(path: str | os.PathLike[str], model: nn.Module, optimizer: DMuon) -> None:
    """Check that :func:`load` would accept ``path`` for ``model`` and ``optimizer``.

    Everything :func:`load` checks before it changes anything — the checkpoint is
    complete, every key is there with a fitting shape, the groups and rules match and
    the groups' hyperparameters check —
    without loading a tensor. For loaders that restore other state first (the
    DeepSpeed integration) and must not stop halfway. Collective like :func:`load`.

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        CheckpointMismatchError: what :func:`load` would refuse.

    Examples:
        >>> import tempfile, torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> from dmuon.integrations import checkpoint
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = DMuon(param_groups(model))
        >>> path = tempfile.mkdtemp()
        >>> checkpoint.save(path, model, opt)
        >>> checkpoint.check(path, model, opt)
    """
    settle(optimizer)
    try:
        _read_checked(os.fspath(path), model, optimizer)
    finally:
        release(optimizer)


@torch.no_grad()
def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: DMuon,
) -> dict[str, Any]:
    """Load a :func:`save` checkpoint into ``model`` and ``optimizer``, at any world size.

    Call it on every rank of the new job after building the model (and
    ``dedicate`` / ``fully_shard``) and the optimizer as for a fresh start. The
    world size, the mode and hence the owner plan may differ from the saved run's:
    each owner of the new plan receives its matrices' state, FSDP2 shards their
    rows, and training continues as the saved run would have (to floating-point
    tolerance across world sizes; bitwise at the same world size on CPU).
    Everything is checked before anything changes.

    Args:
        path: a checkpoint directory written by :func:`save`.
        model: the model, built as for the saved run.
        optimizer: a :class:`~dmuon.optim.DMuon` with the same groups and rules.

    Returns:
        The ``extra`` values given to :func:`save` (``{}`` if none).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint, on this rank or on
            another (every rank raises).
        CheckpointMismatchError: a missing key, a shape that differs, a group with
            another rule, other parameters or hyperparameters that do not check
            (nothing is changed).
        CheckpointReadError: a data file could not be read (truncated, corrupt,
            missing); nothing is changed.

    Examples:
        >>> import tempfile, torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> from dmuon.integrations import checkpoint
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = DMuon(param_groups(model))
        >>> path = tempfile.mkdtemp()
        >>> checkpoint.save(path, model, opt)
        >>> wide = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Linear(9, 2))
        >>> checkpoint.load(path, wide, DMuon(param_groups(wide)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        dmuon...CheckpointMismatchError: the checkpoint does not fit ...
    """
    path = os.fspath(path)
    settle(optimizer)
    try:
        held, groups, small, model_sd, saved_dtypes = _read_checked(path, model, optimizer)
        # Phase 2: the tensors, into fresh ones: the model's (laid out as its own,
        # DTensors included) and the optimizer's (of the saved dtypes), copied in once
        # every file was read, so a file that fails to read changes nothing.
        targets = state_targets(optimizer, held, saved_dtypes)
        weights = {
            k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
            for k, v in model_sd.items()
        }
        _dcp_load({"model": weights, "optim": {"state": targets}}, path)
        with checkpoint_deadline(optimizer, "DMuon checkpoint load"):
            to_owners(optimizer, held, targets)  # tensor-parallel state: pieces to owners
        set_model_state_dict(model, weights)
        load_into_optimizer(optimizer, held, targets, groups)
    finally:
        release(optimizer)
    extra = small.get("extra")
    if extra is None:
        return {}
    return _extra_from(extra) if isinstance(extra, bytes) else dict(extra)
