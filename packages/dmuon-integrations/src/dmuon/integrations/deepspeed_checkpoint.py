"""DeepSpeed checkpoints that keep DMuon's optimizer state: save and load them.

``engine.save_checkpoint`` alone cannot hold DMuon's state. At ZeRO stage 0 DeepSpeed
writes the optimizer's ``state_dict()`` of data-parallel rank 0 only, and DMuon's
state is rank-local (each matrix's momentum lives on the rank that steps it: rank 1's
matrices would restart from zero; :meth:`dmuon.optim.DMuon.load_state_dict` refuses
such a dict on every rank but 0). At stages 1/2 each rank writes ZeRO's partition of
the *scalar* state; the matrices' momentum is held by DMuon, outside ZeRO.

So :func:`save_checkpoint` writes, beside DeepSpeed's files, DMuon's state as a DCP
checkpoint (:func:`dmuon.integrations.checkpoint.save`: each owner-held tensor once)
in ``<save_dir>/<tag>/dmuon/``, and :func:`load_checkpoint` checks DMuon's part, then
loads DeepSpeed's (module weights, ZeRO's scalar state, the scheduler) and DMuon's
state, resharded to the current owner plan. So a stage-0 checkpoint loads at another
world size; ZeRO-1/2 load their partitions only at the world size that saved them
(DeepSpeed raises otherwise). The layout::

    <save_dir>/latest                      # written last: names a complete checkpoint
    <save_dir>/<tag>/mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt, ...
    <save_dir>/<tag>/dmuon/.metadata, *.distcp

Saving again under an existing tag overwrites it in place, while ``latest`` may
already name it: a crash in between leaves that checkpoint torn. Use a new tag per
save (the default, ``global_step<N>``, is one).

A plain ``engine.load_checkpoint`` of such a checkpoint restores everything but
DMuon's state; at stages 1/2 :class:`~dmuon.integrations.deepspeed_optimizer.ZeroClientOptimizer`
then raises instead of training on with the matrices' momentum at zero.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dmuon.integrations import checkpoint
from dmuon.integrations.deepspeed_optimizer import (
    ZeroClientOptimizer,
    client_optimizer,
    dmuon_of,
)

__all__ = ["DMUON_SUBDIR", "load_checkpoint", "save_checkpoint"]

DMUON_SUBDIR = "dmuon"
"""The directory, inside a tag's directory, that holds DMuon's DCP checkpoint."""


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    **options: Any,
) -> str:
    """``engine.save_checkpoint`` plus DMuon's optimizer state (``<save_dir>/<tag>/dmuon/``).

    Call it on every rank at the same point (between steps), with the same ``tag``.
    DMuon's part is written first and DeepSpeed's ``latest`` file last, so ``latest``
    only ever names a checkpoint that holds both. In owner mode the owners' last
    published weights are waited for first, so DeepSpeed saves current weights.

    Args:
        engine: an engine made by :func:`dmuon.integrations.deepspeed.initialize`.
        save_dir: the checkpoint root directory.
        tag: the checkpoint's name; ``None``: ``global_step<N>``, as DeepSpeed names it.
        client_state: your values to keep (DeepSpeed's ``client_state``, returned by
            :func:`load_checkpoint`).
        save_latest: write the ``latest`` file (DeepSpeed's argument).
        **options: more arguments of ``engine.save_checkpoint``
            (``exclude_frozen_parameters``).

    Returns:
        The tag saved.

    Raises:
        TypeError: the engine's optimizer was not made by
            :func:`~dmuon.integrations.deepspeed.initialize`.

    Examples:
        >>> tag = save_checkpoint(engine, "ckpt")  # doctest: +SKIP
        >>> tag  # doctest: +SKIP
        'global_step20'
    """
    optimizer = dmuon_of(engine)  # before anything is written: a foreign engine fails here
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    checkpoint.save(os.path.join(os.fspath(save_dir), tag, DMUON_SUBDIR), engine.module, optimizer)
    engine.save_checkpoint(
        save_dir, tag=tag, client_state=dict(client_state or {}), save_latest=save_latest, **options
    )
    return tag


def _latest_tag(load_dir: str) -> str:
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        raise FileNotFoundError(
            f"{latest!r} does not exist: {load_dir!r} holds no finished checkpoint saved with "
            "save_latest=True; pass tag= to name one"
        )
    with open(latest) as f:
        return f.read().strip()


@contextmanager
def _dmuon_state_loaded_after(engine: Any) -> Iterator[None]:
    # ZeroClientOptimizer.load_state_dict refuses a checkpoint whose DMuon state nobody
    # loads; here it is loaded right after DeepSpeed's part.
    client = client_optimizer(engine)
    if not isinstance(client, ZeroClientOptimizer):
        yield
        return
    client.dmuon_state_loaded_separately = True
    try:
        yield
    finally:
        client.dmuon_state_loaded_separately = False


def load_checkpoint(
    engine: Any,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    **options: Any,
) -> tuple[str, dict[str, Any]]:
    """Load a :func:`save_checkpoint` checkpoint: DeepSpeed's part, then DMuon's state.

    Call it on every rank after :func:`~dmuon.integrations.deepspeed.initialize`, as
    for a fresh start. The owner plan may differ from the saved run's (another world
    size): each owner of the current plan receives its matrices' state. At the same
    world size on CPU, training then continues bitwise as the saved run would have.

    Args:
        engine: an engine made by :func:`dmuon.integrations.deepspeed.initialize`.
        load_dir: the checkpoint root directory given to :func:`save_checkpoint`.
        tag: which checkpoint; ``None``: the one the ``latest`` file names.
        load_optimizer_states: ``False`` loads the weights (and the scheduler) only:
            DeepSpeed's optimizer part and DMuon's state are both left as they are.
        **options: more arguments of ``engine.load_checkpoint``
            (``load_module_strict``, ``load_lr_scheduler_states``, ...).

    Returns:
        ``(load_path, client_state)``, as ``engine.load_checkpoint`` returns them.

    Raises:
        FileNotFoundError: no ``latest`` file (and no ``tag``), or the checkpoint has
            no DMuon part (saved by ``engine.save_checkpoint`` alone, or unfinished) —
            raised before anything is loaded.
        dmuon.integrations.checkpoint.CheckpointMismatchError: DMuon's part does not
            fit the current optimizer (another model, rule or groups) — raised before
            anything is loaded.

    Examples:
        >>> path, client_state = load_checkpoint(engine, "ckpt")  # doctest: +SKIP
    """
    load_dir = os.fspath(load_dir)
    optimizer = dmuon_of(engine)
    tag = _latest_tag(load_dir) if tag is None else str(tag)
    dmuon_dir = os.path.join(load_dir, tag, DMUON_SUBDIR)
    wants_state = load_optimizer_states and not options.get("load_module_only", False)
    if wants_state and not os.path.isfile(os.path.join(dmuon_dir, ".metadata")):
        raise FileNotFoundError(
            f"{dmuon_dir!r} holds no DMuon state: checkpoint {tag!r} was saved by "
            "engine.save_checkpoint alone (which cannot hold the owners' matrix momentum), or "
            "its save did not finish. Save with dmuon.integrations.deepspeed.save_checkpoint; "
            "to load only the weights, pass load_optimizer_states=False"
        )
    if wants_state:  # DMuon's part must fit before DeepSpeed's is loaded: no half-loads
        checkpoint.check(dmuon_dir, engine.module, optimizer)
    # At stage 0 DeepSpeed's optimizer part is DMuon's state_dict of rank 0 alone: skip it
    # (DMuon's part holds every rank's state). At stages 1/2 it is ZeRO's scalar state.
    stage = engine.zero_optimization_stage()
    with _dmuon_state_loaded_after(engine):
        load_path, client_state = engine.load_checkpoint(
            load_dir, tag, load_optimizer_states=load_optimizer_states and stage > 0, **options
        )
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {load_dir!r}")
    if wants_state:
        checkpoint.load(dmuon_dir, engine.module, optimizer)
    if stage == 0 and client_state is not None:
        # not loaded, so DeepSpeed left it in: rank 0's rank-local DMuon state dict
        client_state.pop("optimizer", None)
    return load_path, client_state
