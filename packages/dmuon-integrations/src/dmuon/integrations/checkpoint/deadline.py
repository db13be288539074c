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

The collectives of torch's own checkpoint machinery that these functions call
(DCP's planning and writes, ``get_model_state_dict``, ``DTensor.full_tensor``,
``distribute_tensor``) wait under the process group's timeout: torch gives them no
deadline of their own.
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
