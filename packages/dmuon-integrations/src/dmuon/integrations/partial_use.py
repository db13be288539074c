"""A parameter FSDP2 synchronises must be used on every rank, or FSDP2's backward hangs.

FSDP2 reduce-scatters the gradients of the parameters of a ``fully_shard`` unit
that *have* a gradient on this rank. A parameter that one rank's batch never
reached — an expert no token of that rank was routed to, a branch taken on some
ranks only — has none there, so the ranks enter reduce-scatters of different
sizes: gloo hangs or aborts, NCCL may corrupt. DMuon's own owner reductions send
zeros for an absent gradient, so dedicated matrices are safe; the parameters
:func:`dmuon.integrations.fsdp.dedicate` leaves to FSDP2 (embeddings, head,
norms, biases) are not.

:func:`install_partial_use_check` finds the situation before backward starts:
each module that holds such parameters notes, in a forward hook, that it ran;
at the end of every forward with gradients enabled the ranks sum one flag per
parameter (one small all-reduce over twins of the mesh's groups), and a parameter
used on some ranks but not all raises :class:`PartialUseError` on every rank,
naming it and the ranks, before any rank enters FSDP2's reduce-scatter.

A module that is its own ``fully_shard`` unit and runs on some ranks only hangs
earlier, in FSDP2's forward all-gather of that unit, which no check of DMuon's can
precede: the ranks that reach the end of forward then wait in the check and raise
:class:`dmuon.comm.CollectiveError` at DMuon's deadline, the roll call naming the
rank that is elsewhere. Wrap such modules together with a module every rank runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import collective_timeout, wait_work
from dmuon.comm.flags import flag_device

__all__ = ["PartialUseCheck", "PartialUseError", "install_partial_use_check"]

PARTIAL_USE_FLAGS = (
    "all-reduce of parameter-use flags at the end of a training forward (a rank missing "
    "here is still in its forward: in a layer the others did not run, or stalled)"
)
"""The collective of the check, as a :class:`~dmuon.comm.CollectiveError` names it."""


class PartialUseError(RuntimeError):
    """A parameter FSDP2 synchronises was used on some ranks only (raised on every rank).

    Attributes:
        names: the parameters used on some ranks only.

    Examples:
        >>> PartialUseError("experts.1.bias", ["experts.1.bias"]).names
        ['experts.1.bias']
    """

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names


class PartialUseCheck:
    """The check that every rank used ``names`` and ``resharded`` in a training forward.

    Installed as hooks (:meth:`install`), it runs at the end of every forward of
    ``model`` with gradients enabled. A trainer whose training step never calls
    ``model``'s own forward (Lightning calls ``training_step``, which may call the
    submodules alone) sets :attr:`driven` and calls :meth:`begin` before the step's
    forward and :meth:`end` before its backward instead.

    Args:
        model: the root module (its forward ends the check).
        names: the parameters FSDP2 synchronises (``model.named_parameters()`` names).
        groups: the groups whose ranks must agree (twins of the mesh's groups).
        timeout: returns the deadline of the check's all-reduce (DMuon's ``timeout=``).
        resharded: dedicated weights under ``reshard_after_forward=True`` (ZeRO-3-like).
            Their backward pre-hooks re-gather them layer by layer, so a layer whose
            forward ran on some ranks only makes the ranks' broadcasts pair up wrongly:
            gloo aborts a rank on the size mismatch, and two layers of one size would
            swap weights silently. Checked in the same all-reduce.
            The forward's own prefetches may already have differed between the ranks
            (one rank has a broadcast in flight the others never issue), so after this
            error the job cannot go on: the message says to restart.

    Attributes:
        driven: ``True``: the root forward's hooks leave the check to :meth:`begin` and
            :meth:`end`, which the trainer calls.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> check = PartialUseCheck(model, ["0.bias"], [], lambda: None)
        >>> handles = check.install()
        >>> check.driven = True  # a trainer begins and ends it
        >>> check.begin()
        >>> _ = model[0](torch.randn(3, 4))  # a submodule alone
        >>> len(handles), sorted(check.used)
        (3, ['0.bias'])
        >>> check.end()  # no group: nothing to compare
    """

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        groups: Sequence[dist.ProcessGroup | None],
        timeout: Any,
        *,
        resharded: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.groups = list(groups)
        self.timeout = timeout
        self.resharded = set(resharded)
        self.order = sorted(set(names) | self.resharded)
        self.used: set[str] = set()
        self.driven = False
        self._agree: Callable[..., None] | None = None  # install() makes it

    def install(self) -> list[RemovableHandle]:
        """Hook ``model``: each module holding a checked parameter notes that it ran; the
        root forward begins and ends the check (unless :attr:`driven`).

        Returns:
            The hook handles (``handle.remove()`` undoes them).
        """
        watched = set(self.order)
        owned: dict[nn.Module, list[str]] = {}
        for mod_name, module in self.model.named_modules():
            for p_name, _ in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if full in watched:
                    owned.setdefault(module, []).append(full)

        def start(module: nn.Module, args: Any) -> None:
            if not self.driven and torch.is_grad_enabled():
                self.begin()

        def ran(names_here: list[str]) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                if torch.is_grad_enabled():
                    self.used.update(names_here)

            return hook

        used, order, groups = self.used, self.order, self.groups
        timeout, resharded = self.timeout, self.resharded

        def agree(module: nn.Module, args: Any, output: Any, by_trainer: bool = False) -> None:
            # The comparison inline, over locals (end() calls this hook too): under
            # torch.compile dynamo traces the hook, and a call to a function or a method
            # here broke the graph once more, in the deadline's timedelta.
            if (self.driven and not by_trainer) or not torch.is_grad_enabled():
                return  # driven: the trainer's end() compares (a forward inside its step)
            if not groups:
                used.clear()
                return
            flags = torch.tensor(
                [int(n in used) for n in order], dtype=torch.int32, device=flag_device(groups[0])
            )
            mine = set(used)
            used.clear()
            sizes = 1
            with collective_timeout(timeout()):
                for g in groups:
                    work = dist.all_reduce(flags, group=g, async_op=True)
                    wait_work(work, PARTIAL_USE_FLAGS, g)
                    sizes *= dist.get_world_size(g)
            partial = [n for n, f in zip(order, flags.tolist(), strict=True) if 0 < f < sizes]
            if partial:
                raise PartialUseError(_message(partial, mine, resharded), partial)

        self._agree = agree
        handles = [self.model.register_forward_pre_hook(start)]
        handles += [module.register_forward_hook(ran(here)) for module, here in owned.items()]
        handles.append(self.model.register_forward_hook(agree))
        return handles

    def begin(self) -> None:
        """A training forward begins: nothing used yet."""
        self.used.clear()

    def end(self) -> None:
        """A training forward ended: compare what the ranks used (one all-reduce).

        Raises:
            PartialUseError: (every rank alike) a checked parameter was used on some
                ranks only.
            dmuon.comm.CollectiveError: a rank did not reach the check by the deadline.
        """
        if self._agree is None:
            raise RuntimeError("PartialUseCheck.end() before install(): nothing was watched")
        self._agree(self.model, (), None, by_trainer=True)


def install_partial_use_check(
    model: nn.Module,
    names: Sequence[str],
    groups: Sequence[dist.ProcessGroup | None],
    timeout: Any,
    *,
    resharded: Sequence[str] = (),
) -> list[RemovableHandle]:
    """Check, after every training forward of ``model``, that every rank used ``names``
    and ``resharded``: :class:`PartialUseCheck` installed (its arguments).

    Returns:
        The hook handles (``handle.remove()`` undoes them).

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> handles = install_partial_use_check(model, ["0.bias"], [], lambda: None)
        >>> _ = model(torch.randn(3, 4))  # no group: nothing to compare
        >>> len(handles)
        3
    """
    return PartialUseCheck(model, names, groups, timeout, resharded=resharded).install()


def _message(partial: list[str], used: set[str], resharded: set[str]) -> str:
    """What :class:`PartialUseError` says of the parameters used on some ranks only."""
    kinds = (
        (
            [n for n in partial if n not in resharded],
            "parameter(s) {} (synchronised by FSDP2)",
            "FSDP2 leaves a parameter without a gradient out of its reduce-scatter, so the "
            "ranks would hang in backward. Use them on every rank (e.g. run every expert and "
            "multiply an unused one's output by zero), or give them to DMuon: "
            "ddp.dedicate(model, scalars='owner') reduces absent gradients as zeros",
        ),
        (
            [n for n in partial if n in resharded],
            "dedicated weight(s) {}",
            "Under reshard_after_forward=True every rank re-gathers each layer's weights in "
            "its forward and backward, layer by layer, so the ranks' broadcasts no longer "
            "meet: this job cannot go on. Run every dedicated layer on every rank (multiply "
            "an unused branch's output by zero), or keep the weights resident "
            "(reshard_after_forward=False), which handles a layer used on some ranks only, "
            "and restart from the last checkpoint",
        ),
    )
    parts = []
    for names, what, advice in kinds:
        if names:
            mine = [n for n in names if n in used]
            parts.append(
                f"{what.format(names[:5])} were used in this forward on some ranks only "
                f"(this rank used {mine[:5] or 'none of them'}). {advice}"
            )
    return "; ".join(parts)
