"""Checkpoint collectives under the optimizer's deadline.

Saving and loading are collectives: every rank of the optimizer's group takes part.
A rank that never calls :func:`~dmuon.integrations.checkpoint.save` (it crashed, it
took another branch, it is still in its last step) would leave the others in a
``send``/``broadcast`` until the process group's own timeout (30 min under gloo).
DMuon's checkpoint functions issue their own collectives asynchronously and wait
for each with :func:`dmuon.comm.wait_work` under the optimizer's
:meth:`~dmuon.optim.DMuon.collective_deadline`, noting the phase for the roll call,
so the waiting ranks raise :class:`dmuon.comm.CollectiveError` naming the rank that
is missing, as in a step.

DTensors are made whole and cut back by :mod:`~dmuon.integrations.checkpoint.whole`
under the same deadline: the one-file
:func:`~dmuon.integrations.checkpoint.full_state_dict` gathers the model's and the
optimizer's tensor-parallel and FSDP2 shards with DMuon's own all-gathers (torch's
``get_model_state_dict(..., full_state_dict=True)`` and ``DTensor.full_tensor`` did,
untimed), :func:`~dmuon.integrations.checkpoint.load_full_state_dict` cuts every
shard from the dict each rank holds, with no collective (torch's
``set_model_state_dict(..., full_state_dict=True)`` scattered rank 0's), and
torchtitan's load gathers the owners' rows the same way. The DCP save's scatter of
owner-held state into row blocks over the owners' group is DMuon's own too
(:func:`~dmuon.integrations.checkpoint.sharded_state.scattered`, where
``distribute_tensor(..., src_data_rank=owner)`` scattered, untimed).

FSDP2 over tensor parallelism (``_StridedShard`` rows) is gathered by
:func:`~dmuon.integrations.checkpoint.whole.whole_tensor` too, over ``dp`` then ``tp``.

What still waits under the process group's timeout, because torch gives it no
deadline of its own: DCP's planning, reads and writes (``save``/``load``); and the
``DTensor.full_tensor()`` of layouts ``whole_tensor`` leaves to it — a pending sum
(``Partial``, which no parameter or optimizer state is) and any other nesting of two
or more mesh dimensions on one tensor dimension.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dmuon.comm import CollectiveError, collective_timeout
from dmuon.comm.roll_call import note_phase

__all__ = ["checkpoint_deadline"]


@contextlib.contextmanager
def checkpoint_deadline(optimizer: Any, what: str) -> Iterator[None]:
    """Run a checkpoint's collectives under ``optimizer``'s deadline, as phase ``what``.

    A :class:`~dmuon.comm.CollectiveError` raised inside leaves with the ranks that did
    not answer the roll call named and ``what`` in front of its message.

    Args:
        optimizer: the :class:`~dmuon.optim.DMuon` whose state is saved or loaded.
        what: the phase a roll call reports for this rank (e.g. ``"DMuon checkpoint
            save"``).

    Examples:
        >>> import torch
        >>> from dmuon.comm import current_timeout
        >>> from dmuon.optim import DMuon
        >>> opt = DMuon([torch.nn.Parameter(torch.zeros(4, 4))], timeout=5)
        >>> with checkpoint_deadline(opt, "DMuon checkpoint save"):
        ...     current_timeout()
        5.0
    """
    note_phase(what)
    try:
        with collective_timeout(optimizer.collective_deadline()):
            yield
    except CollectiveError as err:  # name the ranks that are missing, as a step does
        raise err.after_roll_call().with_context(what) from err
    finally:
        note_phase(f"outside DMuon ({what} done)")
