"""What ``dedicate()`` returns: the dedicated parameters, their owners, and the hooks."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import (
    CollectiveError,
    CommStats,
    MatrixItem,
    OwnerPlan,
    collective_timeout,
    plan_owners,
)
from dmuon.comm.faults import wait_work
from dmuon.comm.flags import flag_device
from dmuon.comm.plan_adoption import adopt_first_plan
from dmuon.comm.process_groups import check_launched, group_size, twin_groups
from dmuon.integrations.hooks import (
    check_one_module,
    check_untied,
    install_hooks,
    layer_modules,
)
from dmuon.integrations.partial_use import PartialUseCheck
from dmuon.integrations.selection import (
    Predicate,
    mesh_groups,
    split_parameters,
    tensor_parallel_dim,
)
from dmuon.optim import OwnerExchange
from dmuon.optim import deadline as auto_deadline
from dmuon.optim.engine import DEFAULT_PACK_MB, format_description
from dmuon.optim.engine.expert_split import in_place_replicas, replica_owners
from dmuon.optim.engine.params import is_dtensor
from dmuon.optim.engine.placements import placement_of

__all__ = ["Dedication", "build_dedication", "check_dedicate_arguments"]


@dataclass(eq=False)
class Dedication:
    """The parameters dedicated to owner ranks, and how to train with them.

    Pass :attr:`params` to ``fully_shard(..., ignored_params=...)`` (FSDP2 then
    manages everything else) and the dedication itself to
    ``DMuon(..., distributed=ded)`` (optional: DMuon also finds it from the
    parameters).

    Attributes:
        model: the model.
        exchange: the reductions and broadcasts (:class:`dmuon.optim.OwnerExchange`).
        handles: the hooks installed on the model (:meth:`remove` takes them off,
            :meth:`reinstall` puts them back).
        kind: ``"fsdp"``, ``"ddp"`` or ``"deepspeed"`` (what made it).

    Examples:
        >>> import torch
        >>> from dmuon.integrations.ddp import dedicate
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        >>> ded = dedicate(model)  # one process: it owns everything
        >>> ded.names, ded.owned
        (('0.weight', '1.weight'), ('0.weight', '1.weight'))
    """

    model: nn.Module
    exchange: OwnerExchange
    handles: list[RemovableHandle] = field(default_factory=list)
    kind: str = "fsdp"
    installers: list[Callable[[], list[RemovableHandle]]] = field(default_factory=list, repr=False)
    """What installed :attr:`handles`, in order (:meth:`add_hooks`): :meth:`reinstall`
    runs them again."""
    experts: tuple[str, ...] = ()
    """Names of the expert stacks whose mesh spans the dedication's group, which each rank
    steps where they live (``ddp.dedicate``): neither dedicated nor all-reduced with the
    scalars (on a ``dp × ep`` mesh, one owner among each stack's replicas steps it)."""
    use_check: PartialUseCheck | None = field(default=None, repr=False)
    """The check that every rank used what must be used on every rank (``fsdp.dedicate``:
    the parameters left to FSDP2; ``reshard_after_forward=True``: the dedicated weights),
    or None. A trainer that never calls the model's own forward drives it
    (:attr:`PartialUseCheck.driven <dmuon.integrations.partial_use.PartialUseCheck.driven>`)."""

    @property
    def params(self) -> set[nn.Parameter]:
        """The parameters FSDP2 must leave alone, as the set
        ``fully_shard(ignored_params=...)`` takes: the dedicated ones and the expert stacks
        stepped in place (:attr:`experts`)."""
        out: set[nn.Parameter] = set(self.exchange.params)  # type: ignore[arg-type]
        if self.experts:
            names = set(self.experts)
            out |= {p for n, p in self.model.named_parameters() if n in names}
        return out

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the dedicated parameters (canonical order)."""
        return self.exchange.names

    @property
    def owned(self) -> tuple[str, ...]:
        """Names of the parameters this rank owns (steps and broadcasts)."""
        return self.exchange.owned_names

    @property
    def all_reduced(self) -> tuple[str, ...]:
        """Names of the parameters whose gradients are all-reduced (DDP's scalars)."""
        return self.exchange.replicated_names

    @property
    def plan(self) -> OwnerPlan:
        """The owner plan."""
        return self.exchange.plan

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group of the owners (HSDP: the shard group): a twin of the mesh's
        (the same ranks, a communicator of DMuon's own), so that FSDP2's collectives on
        the mesh's group never meet DMuon's reductions."""
        return self.exchange.group

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """HSDP: this rank's replicate group, a twin of the mesh's as :attr:`group` is
        (``None`` otherwise)."""
        return self.exchange.replicate_group

    @property
    def rank(self) -> int:
        """This rank's owner index (HSDP: ``i·S + j``)."""
        return self.exchange.rank

    def owner_of(self, name: str) -> int:
        """The owner rank of dedicated parameter ``name``."""
        return self.exchange.owner(name)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (no reductions).

        Covers the dedicated parameters, the all-reduced ones, and — when the model
        was also passed to FSDP2's ``fully_shard`` — FSDP2's own parameters (through
        its public ``set_requires_gradient_sync``). Run every micro-batch of a
        gradient-accumulation step but the last inside it.
        """
        fsdp = _fsdp_modules(self.model)
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            with self.exchange.reduction.no_sync():
                yield
        finally:
            for m in fsdp:
                m.set_requires_gradient_sync(True, recurse=False)

    def wait(self) -> None:
        """Wait until every rank holds the owners' latest weights.

        The forward waits layer by layer on its own; call this before reading the
        weights outside a forward (evaluation code, saving a checkpoint). Call it on every
        rank: it also counts as every layer's wait for the check that refuses a gradient
        from a forward past a layer's hooks (:meth:`Publication.mark_all_waited
        <dmuon.optim.engine.Publication.mark_all_waited>`), and a call on some ranks only
        would let those ranks go on where the others refuse.
        """
        self.exchange.wait_all_published()

    def remove(self, *, wait: bool = True) -> None:
        """Remove the hooks (the parameters stay dedicated to this exchange); put them back
        with :meth:`reinstall`. Call it on every rank: the broadcasts still in flight are
        waited first (no forward would wait for them after), under HSDP with the second
        stage's broadcasts (ZeRO-3-like: the expert stacks' alone).

        Args:
            wait: ``False`` after an error that left the ranks' collectives out of step
                (a :class:`~dmuon.comm.CollectiveError`, or a
                :class:`~dmuon.integrations.PartialUseError` under
                ``reshard_after_forward``): the broadcasts in flight may never complete, so
                they are not waited for, and the weights are not to be trained further.
        """
        if wait:
            self.exchange.publication.wait_in_flight()
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def undedicate(self) -> None:
        """Remove the hooks and let the parameters go, so that they can be dedicated again
        (:meth:`OwnerExchange.undedicate <dmuon.optim.engine.OwnerExchange.undedicate>`): for
        a setup that failed after ``dedicate()``, e.g. a refused optimizer option. Call it
        on every rank; the dedication is not used afterwards.
        """
        self.remove()
        self.exchange.undedicate()
        _release(self.exchange)

    def add_hooks(self, installer: Callable[[], list[RemovableHandle]]) -> None:
        """Run ``installer`` (it installs hooks on the model and returns their handles),
        keep its handles in :attr:`handles` and remember it for :meth:`reinstall`."""
        self.handles += installer()
        self.installers.append(installer)

    def reinstall(self) -> None:
        """Put back every hook ``dedicate`` installed, after :meth:`remove` (e.g. once the
        model's modules were swapped): the exchange's (:func:`~dmuon.integrations.
        install_hooks`), and ``ddp.dedicate``'s buffer broadcast or ``fsdp.dedicate``'s
        partial-use check, which ``install_hooks`` alone does not restore.

        Raises:
            RuntimeError: hooks are installed already (they would run twice).

        Examples:
            >>> import torch
            >>> from dmuon.integrations.ddp import dedicate
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
            >>> ded = dedicate(model)
            >>> n = len(ded.handles)
            >>> ded.remove()
            >>> ded.reinstall()
            >>> len(ded.handles) == n
            True
        """
        if self.handles:
            raise RuntimeError(
                f"the dedication's {len(self.handles)} hooks are installed; call remove() "
                "before reinstall(), or they would run twice"
            )
        for installer in self.installers:
            self.handles += installer()

    def summary(self) -> str:
        """The plan and, per layer, each parameter's owner."""
        return format_description(self.exchange.describe())

    def __repr__(self) -> str:
        return (
            f"Dedication(kind={self.kind!r}, {len(self.names)} dedicated, "
            f"{len(self.all_reduced)} all-reduced, "
            + (f"{len(self.experts)} expert stacks in place, " if self.experts else "")
            + f"rank {self.rank} owns {len(self.owned)}, "
            f"plan={self.plan!r})"
        )


def _fsdp_modules(model: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check_dedicate_arguments(
    model: object,
    *,
    predicate: object = None,
    layer_of: object = None,
    stats: object = None,
) -> None:
    """Refuse arguments of the wrong kind before anything reads them.

    ``dedicate(model.parameters())`` (torch's optimizers take the parameters; dedicate needs
    the modules, for the names, the layers and the hooks) ended in an ``AttributeError``
    inside the split; ``stats=1`` was kept and failed at the first step, far from the call.
    ``layer_of``'s results are checked where it is called
    (:func:`~dmuon.integrations.selection.split_parameters`).

    Raises:
        TypeError: ``model`` not an ``nn.Module``, ``predicate`` or ``layer_of`` not
            callable, ``stats`` neither ``None`` nor a :class:`~dmuon.comm.CommStats`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"dedicate() takes the model (an nn.Module), got {type(model).__name__}: call "
            "dedicate(model), not dedicate(model.parameters()); it needs the modules for the "
            "parameters' names, their layers and its hooks"
        )
    if predicate is not None and not callable(predicate):
        raise TypeError(
            f"predicate must be None or a function (name, param) -> bool choosing the dedicated "
            f"parameters, got {type(predicate).__name__}: {predicate!r}"
        )
    if not callable(layer_of):
        raise TypeError(
            f"layer_of must be a function name -> layer key (a str; default "
            f"dmuon.comm.layer_key), got {type(layer_of).__name__}: {layer_of!r}"
        )
    if stats is not None and not isinstance(stats, CommStats):
        raise TypeError(
            f"stats must be None (dmuon.comm.default_stats()) or a dmuon.comm.CommStats, where "
            f"the dedication records its bytes, got {type(stats).__name__}: {stats!r}"
        )


def check_unwrapped_and_launched(model: nn.Module) -> None:
    """Refuse the two set-up slips a first ``dedicate()`` meets, before any collective.

    A model already wrapped in ``DistributedDataParallel``: DDP would all-reduce the
    gradients that ``dedicate`` reduces to their owners. A process that a launcher started
    as one of several (``WORLD_SIZE`` > 1, as ``torchrun`` sets it) but that has not called
    ``init_process_group``: without a process group ``dedicate`` plans for one rank, and
    every process would train alone.

    Raises:
        TypeError: ``model`` is a ``DistributedDataParallel``.
        RuntimeError: ``WORLD_SIZE`` > 1 and torch.distributed is not initialised.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "dedicate() was given a DistributedDataParallel: dedicate replaces the DDP wrapper "
            "(it reduces each matrix's gradient to its owner, DDP would all-reduce them too). "
            "Pass the model itself, dedicate(model), and do not wrap it; to keep the wrapper, "
            "use DMuon(param_groups(ddp_model.module), mode='replicated') without dedicate()"
        )
    check_launched("dedicate()")


def build_dedication(
    model: nn.Module,
    mesh: Any,
    *,
    predicate: Predicate | None,
    strategy: str,
    layer_of: Callable[[str], str],
    stats: CommStats | None,
    all_reduce_rest: bool,
    kind: str,
    plan_options: dict[str, Any],
    dedicate_rest: bool = False,
    reshard_after_forward: bool = False,
    reduce_op: str = "avg",
    free_local_grads: bool = False,
    layer_pack_mb: float = DEFAULT_PACK_MB,
    experts_in_place: bool = False,
    check_rest_use: bool = False,
) -> Dedication:
    """Plan owners for ``model``'s dedicated parameters, build their exchange, hook it in.

    What ``fsdp.dedicate``, ``ddp.dedicate`` and the DeepSpeed integration share:
    split the parameters (``predicate``), plan the dedicated ones over the mesh's
    ranks (:func:`~dmuon.comm.plan_owners`), build the
    :class:`~dmuon.optim.OwnerExchange` (the rest all-reduced when
    ``all_reduce_rest``, or dedicated too when ``dedicate_rest``) and install its
    hooks (:func:`~dmuon.integrations.install_hooks`).

    On a 2-D ``dp × tp`` mesh whose ``tp`` dimension the model's tensor-parallel
    DTensors use (:func:`~dmuon.integrations.selection.tensor_parallel_dim`), owners are
    planned over ``dp`` by the whole matrices' shapes and each owner's ``tp`` row steps
    the shards (:mod:`dmuon.optim.engine.owner_split`).

    With ``experts_in_place`` (``ddp.dedicate``, ``fsdp.dedicate``; not beside ``tp`` or
    HSDP), an expert stack split along its expert dimension whose mesh spans exactly the
    planning group (:func:`in_place_experts`) is left out of the plan: each rank steps its
    experts where they live (on a ``dp × ep`` mesh, the stacks it owns among their
    replicas), and the plan starts each rank's load with them (``plan_owners(held=...)``:
    :func:`held_experts`). :attr:`Dedication.params` includes them, so FSDP2 leaves them
    alone too. With ``reduce_op="avg"`` a hook divides their gradient by the group's size
    as it arrives, as the dense gradients are averaged: the expert dispatch's backward
    sums every rank's loss into it, and the gradient of the ranks' mean loss is that sum
    over the ranks.

    Raises:
        ValueError: a parameter already sharded by FSDP2, a DTensor owner mode does not
            take (named with its placements), or nothing to dedicate.
        TypeError: see :func:`check_dedicate_arguments`, and (with RuntimeError)
            :func:`check_unwrapped_and_launched`.
    """
    check_dedicate_arguments(model, predicate=predicate, layer_of=layer_of, stats=stats)
    check_unwrapped_and_launched(model)
    dedicated, rest = split_parameters(
        model, predicate, layer_of=layer_of, dedicate_rest=dedicate_rest
    )
    # read from the parameters DMuon synchronises only: the others may already be FSDP2's
    # over dp (fully_shard(..., ignored_params=) before dedicate: torchtitan's owner mode)
    mine = [p for _, p in dedicated] + ([p for *_, p in rest] if all_reduce_rest else [])
    tp_dim = tensor_parallel_dim(mesh, model, mine)
    if tp_dim is None:
        group, replicate_group = mesh_groups(mesh)
        if replicate_group is not None and group_size(replicate_group) == 1:
            replicate_group = None  # HSDP of one replica: FSDP2 over the shard group
    else:  # dp × tp: owners over the dimension the tensor-parallel placements do not use
        group, replicate_group = mesh.get_group(1 - tp_dim), None
    tp_group = None if tp_dim is None else mesh.get_group(tp_dim)
    experts = (
        in_place_experts(dedicated, group)
        if experts_in_place and tp_dim is None and replicate_group is None
        else []
    )
    if experts:
        dedicated = [(i, p) for i, p in dedicated if all(p is not q for _, q in experts)]
    _check_dtensors(
        dedicated,
        rest if all_reduce_rest else [],
        group,
        tensor_parallel=tp_dim is not None,
        reshard_after_forward=reshard_after_forward,
        kind=kind,
    )
    if not dedicated:
        raise ValueError(
            "no parameter to dedicate: the model has no matrix parameters (or the predicate "
            "chose none); use plain FSDP2/DDP, or pass a predicate"
        )
    if reshard_after_forward:  # before the exchange frees any weight: the dedicated ones'
        names: dict[str, list[str]] = {}
        for item, _ in dedicated:
            names.setdefault(item.layer if item.layer is not None else item.name, []).append(
                item.name
            )
        check_one_module({k: layer_modules(model, [k], ns) for k, ns in names.items()})
        check_untied(model, [p for _, p in dedicated], layer_of)
    S = group_size(group)
    R = group_size(replicate_group) if replicate_group is not None else 1
    held = held_experts(experts, group) if experts else None
    plan = plan_owners(
        [item for item, _ in dedicated],
        R * S,
        strategy=strategy,
        replicate_size=R,
        held=held,
        **plan_options,
    )
    # The plan's agreement, the model check and the first broadcast of the weights:
    # before DMuon(timeout=) exists, under the floor of timeout="auto" (a rank that never
    # dedicates is an error within minutes, not the process group's half hour).
    seconds = auto_deadline.AUTO_FLOOR_SECONDS
    try:
        with collective_timeout(seconds):
            group, replicate_group, taken = _own_groups(group, replicate_group)
            # An ILP plan made under a wall-clock limit can differ between ranks: every
            # rank takes the first one's (only a fingerprint travels when they agree), over
            # the shard group then the replicate group, or dp then tp (the tp ranks of a
            # dp × tp mesh step the same owned matrices).
            also = replicate_group if replicate_group is not None else tp_group
            plan = adopt_first_plan(plan, [group] if also is None else [group, also])
            exchange = OwnerExchange(
                dedicated,
                plan=plan,
                replicated=rest if all_reduce_rest else (),
                group=group,
                replicate_group=replicate_group,
                stats=stats,
                reshard_after_forward=reshard_after_forward,
                reduce_op=reduce_op,
                free_local_grads=free_local_grads,
                layer_pack_mb=layer_pack_mb,
                experts=[p for _, p in experts],
            )
    except CollectiveError as err:
        raise err.with_context(
            f"{kind}.dedicate() (the plan's agreement, the model check and rank 0's first "
            f"broadcast, under the default deadline of {seconds:g} s: every rank must call "
            "dedicate())"
        ) from err
    _hold(exchange, taken)
    ded = Dedication(model, exchange, kind=kind, experts=tuple(i.name for i, _ in experts))
    ded.add_hooks(lambda: install_hooks(model, exchange))
    _check_use(ded, check_rest_use)
    return ded


MAX_LIVE_DEDICATIONS = 64
"""The most dedications over one set of ranks alive at once in a process: each reduces
over a twin of its own (a slot of :func:`~dmuon.comm.process_groups.twin_groups`)."""

# ranks → twin slot → the exchange reducing over that twin (weakly): the live ones
_HELD: dict[tuple[int, ...], dict[int, weakref.ref[OwnerExchange]]] = {}


def _own_groups(
    group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, list[tuple[tuple[int, ...], int]]]:
    """Twins of the owners' groups (the same ranks, communicators of DMuon's own:
    :func:`~dmuon.comm.process_groups.twin_groups`), over which the exchange reduces and
    broadcasts, with the ``(ranks, slot)`` of each twin taken.

    Each live dedication over a set of ranks reduces over a twin of its own (its slot):
    a rank that used every layer of a model launches its reductions in backward, one
    that left a layer unused holds them to the step, so with two dedicated models
    trained together (a GAN; an encoder and a decoder, each with its optimizer) the two
    exchanges' reductions would meet on one communicator in different orders on
    different ranks, one model's gradients averaged with the other's, or wait for each
    other until the process group's timeout. The slot is the lowest one no live
    dedication holds on any rank of the group (agreed in the all-reduce below, so every
    rank takes the same); an undedicated or collected one gives its slot back, and the
    twin is reused by the next dedication over those ranks.

    FSDP2 issues its reduce-scatters and all-gathers on the mesh's groups in an order of
    its own: with a dedicated layer used on some ranks only, one rank's reductions
    (launched in backward) would otherwise be matched with another rank's reduce-scatter,
    and both would hang until the process group's timeout. Each group is first answered
    by one tiny all-reduce under the current deadline: making a twin waits for every
    member without one (a rank that never calls ``dedicate()`` would hold the others
    there for the process group's half hour)."""

    def own(g: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        if group_size(g) == 1:
            return g  # a group of one: no collective to keep apart
        ranks = tuple(dist.get_process_group_ranks(dist.group.WORLD if g is None else g))
        held = _HELD.get(ranks, {})
        if any(ref() is not None for ref in held.values()):
            # a dedication dropped without undedicate() lives on in its reference cycles
            # (exchange, hooks, model) until a collection: without one, each dedicate()
            # of a loop that drops the last took a new slot, and a new communicator
            gc.collect()
        free = torch.tensor(
            [int(k not in held or held[k]() is None) for k in range(MAX_LIVE_DEDICATIONS)],
            dtype=torch.int32,
            device=flag_device(g),
        )
        wait_work(
            dist.all_reduce(free, group=g, async_op=True),
            "all-reduce that every rank is in dedicate(), with the twin slots it holds free, "
            "before DMuon's own groups are made",
            g,
        )
        n = group_size(g)
        slots = [k for k, count in enumerate(free.tolist()) if count == n]
        if not slots:
            raise RuntimeError(
                f"{MAX_LIVE_DEDICATIONS} dedications over ranks {list(ranks)} are alive on some "
                "rank (a dropped one lives until its model and optimizer are collected); call "
                "undedicate() on every rank for the ones no longer trained"
            )
        slot = slots[0]
        taken.append((ranks, slot))
        return twin_groups([g], purpose="reduce", slot=slot)[0]

    taken: list[tuple[tuple[int, ...], int]] = []
    twins = own(group), None if replicate_group is None else own(replicate_group)
    return twins[0], twins[1], taken


def _hold(exchange: OwnerExchange, taken: list[tuple[tuple[int, ...], int]]) -> None:
    """Record that ``exchange`` reduces over the twins of ``taken`` (ranks, slot): while it
    lives (its hooks, its optimizer or the caller hold it) and is not undedicated, no
    other dedication over those ranks takes them."""
    for ranks, slot in taken:
        _HELD.setdefault(ranks, {})[slot] = weakref.ref(exchange)


def _release(exchange: OwnerExchange) -> None:
    """Give back the twin slots ``exchange`` holds (:meth:`Dedication.undedicate`, on every
    rank: the next ``dedicate()`` over the same ranks may take them)."""
    for held in _HELD.values():
        for slot in [k for k, ref in held.items() if ref() is exchange]:
            del held[slot]


def _check_use(ded: Dedication, rest: bool) -> None:
    """Install the check that every rank used what must be used on every rank
    (:class:`~dmuon.integrations.partial_use.PartialUseCheck`, one all-reduce at
    the end of each training forward): with ``rest``, the parameters left to FSDP2; under
    ``reshard_after_forward``, the dedicated weights, which backward re-gathers layer by
    layer."""
    ex = ded.exchange
    model = ded.model
    groups = [ex.group] if group_size(ex.group) > 1 else []
    if ex.replicate_group is not None and group_size(ex.replicate_group) > 1:
        groups.append(ex.replicate_group)
    if not groups:
        return
    dedicated = {id(p) for p in ded.params}
    names = (
        [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in dedicated]
        if rest
        else []
    )
    resharded = list(ex.names) if ex.publication.reshard_after_forward else []
    if names or resharded:
        ded.use_check = PartialUseCheck(
            model,
            names,
            twin_groups(groups, purpose="use"),
            lambda: ex.publication.timeout,
            resharded=resharded,
        )
        ded.add_hooks(ded.use_check.install)


def in_place_experts(
    dedicated: list[tuple[MatrixItem, Any]], group: dist.ProcessGroup | None
) -> list[tuple[MatrixItem, Any]]:
    """The expert stacks among ``dedicated`` (split along their expert dimension:
    :attr:`~dmuon.optim.engine.placements.MatrixPlacement.expert_split`) whose mesh spans
    exactly the ranks of ``group`` (:func:`~dmuon.optim.engine.expert_split.
    in_place_replicas`): a 1-D ``ep`` mesh over them, or a ``dp × ep`` mesh. Each rank
    steps its own experts where they live (on ``dp × ep``, one owner among the replicas of
    the same experts steps each stack). A stack laid out over other ranks is not among
    them, and
    :func:`_check_dtensors` refuses it."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    everyone = group if group is not None else dist.group.WORLD
    planning = dist.get_process_group_ranks(everyone)
    out = []
    for item, p in dedicated:
        if not is_dtensor(p) or len(item.shape) <= 2:
            continue
        pl = placement_of(p, item.name, stack=True)
        if pl.expert_split and in_place_replicas(p, pl.shards[0][0], planning) is not None:
            out.append((item, p))
    return out


def held_experts(
    experts: list[tuple[MatrixItem, Any]], group: dist.ProcessGroup | None
) -> list[list[MatrixItem]]:
    """Per rank of ``group``, the experts it steps where they live, as ``plan_owners``
    takes them (``held``), read from the placements and the mesh alone (no collective).

    Rank ``r`` holds the block of each stack at its coordinate along the expert mesh
    dimension, ``E`` split as DTensor's ``Shard`` splits it (``torch.chunk``: the first
    blocks one larger, the last ones empty when ``E`` is less than the dimension's size).
    With replicas (a ``dp × ep`` mesh) it steps the stacks it owns among the ranks holding
    the same block (:func:`~dmuon.optim.engine.expert_split.replica_owners`, as the
    optimizer's engine plans them). Named ``stack[rank r]`` as ``sharded`` mode names them.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    # per rank: the stacks it holds, by the ranks holding the same block (its replica set)
    local: dict[int, dict[tuple[int, ...], list[MatrixItem]]] = {r: {} for r in ranks}
    for item, p in experts:
        pl = placement_of(p, item.name, stack=True)
        mesh_dim, dim = pl.shards[0][0], pl.shards[0][1]
        layout = p.device_mesh.mesh  # the ranks, laid out as the mesh
        size = layout.shape[mesh_dim]
        blocks = [len(b) for b in torch.arange(item.shape[dim]).chunk(size)]
        blocks += [0] * (size - len(blocks))
        for rank in ranks:
            coordinate = int((layout == rank).nonzero()[0][mesh_dim])
            same = tuple(sorted(layout.select(mesh_dim, coordinate).flatten().tolist()))
            shape = (*item.shape[:dim], blocks[coordinate], *item.shape[dim + 1 :])
            local[rank].setdefault(same, []).append(replace(item, shape=shape))
    held: list[list[MatrixItem]] = []
    for r, rank in enumerate(ranks):
        mine: list[MatrixItem] = []
        for same, items in local[rank].items():
            owners = replica_owners(items, len(same))
            index = same.index(rank)
            mine += [
                replace(i, name=f"{i.name}[rank {r}]")
                for i in items
                if owners[i.name] == index and i.numel > 0
            ]
        held.append(mine)
    return held


def _check_dtensors(
    dedicated: list[tuple[Any, Any]],
    all_reduced: list[tuple[str, str, Any]],
    group: dist.ProcessGroup | None,
    *,
    tensor_parallel: bool,
    reshard_after_forward: bool,
    kind: str = "ddp",
) -> None:
    """Refuse every DTensor parameter owner mode does not take, on every rank alike (the
    placements and groups are the same everywhere), before any collective.

    Taken on a ``dp × tp`` mesh: a dedicated 2-D matrix split over ``tp`` alone
    (:attr:`~dmuon.optim.engine.placements.MatrixPlacement.tensor_split`), a dedicated
    matrix replicated whole over ``tp`` alone (its owner's ``tp`` row steps its copies
    alike: :attr:`~dmuon.optim.engine.placements.MatrixPlacement.replicated_whole`), a
    dedicated or all-reduced scalar laid out over ``tp`` alone. Refused: anything sharded over the
    planning group itself (FSDP2's rows: dedicate before ``fully_shard``), expert splits
    (``ddp.dedicate`` has taken out those it steps in place: :func:`in_place_experts`),
    other layouts, and tensor parallelism with ``reshard_after_forward``.
    """
    planning: set[int] = set()
    me = -1
    if dist.is_available() and dist.is_initialized():
        me = dist.get_rank()
        everyone = group if group is not None else dist.group.WORLD
        planning = set(dist.get_process_group_ranks(everyone))

    def crosses(p: Any) -> bool:
        """``p``'s mesh splits or replicates it over more of the planning group than me."""
        mesh = p.device_mesh
        return group_size(group) > 1 and any(
            len(set(dist.get_process_group_ranks(mesh.get_group(d))) & planning - {me}) > 0
            for d in range(mesh.ndim)
        )

    for item, p in dedicated:
        if not is_dtensor(p):
            continue
        name = item.name
        pl = placement_of(p, name, stack=p.dim() > 2 and len(item.shape) > 2)
        matrix = p.dim() >= 2
        taken = (
            tensor_parallel
            and not crosses(p)
            and (pl.tensor_split or pl.replicated_whole or not matrix)
        )
        if taken and reshard_after_forward:
            raise ValueError(
                f"parameter {name!r} is tensor-parallel ({pl.summary()}): owner mode over a "
                "dp × tp mesh keeps the dedicated weights resident; reshard_after_forward "
                "(ZeRO-3-like) is for plain tensors on a 1-D group. Drop "
                "reshard_after_forward=True"
            )
        if taken:
            continue
        if pl.expert_split:
            spans = in_place_replicas(p, pl.shards[0][0], planning) is not None
            raise ValueError(
                f"expert stack {name!r} has placements {pl.summary()} ({pl.what()}): "
                "ddp.dedicate steps an expert stack where it lives when its mesh spans the "
                "dedication's ranks exactly (Shard on a 1-D 'ep' mesh over them, or on the "
                "'ep' dimension of a 'dp × ep' mesh over them). "
                + (
                    f"The {kind} integration dedicates whole matrices only: train this model "
                    "with ddp.dedicate(model), which all-reduces the scalar parameters"
                    if spans
                    else "Laid out over other ranks, as this one, its experts are stepped by "
                    "DMuon(..., mode='replicated', process_group=mesh.get_group('dp')) "
                    "without a dedication (one owner among the replicas), or by "
                    "mode='single' (each rank its own experts as a batch)"
                )
            )
        beside = (pl.tensor_split or pl.replicated_whole) and not crosses(p)
        if beside and not tensor_parallel:  # TP beside a 1-D group
            how = (
                "tensor-parallel matrices (parallelize_module on a 'tp' mesh dimension) are "
                "stepped by owner mode over a 2-D dp × tp mesh: pass the whole 2-D "
                "DeviceMesh, not one of its dimensions, to dedicate(model, mesh) (owners over "
                "the dimension the placements do not use); a 1-D group plans owners over plain "
                "matrices only"
            )
        else:
            how = (
                "If fully_shard() made it, dedicate() was called after fully_shard(): call "
                "dedicate(model, mesh) first, then "
                "fully_shard(model, mesh=mesh, ignored_params=ded.params), so FSDP2 leaves the "
                "dedicated matrices to their owners; owner mode takes tensor-parallel "
                "matrices split over the tp dimension of a dp × tp mesh (Shard(0) or "
                "Shard(1) there, Replicate() elsewhere), or replicated whole over it: keep this "
                "one out of the "
                "dedication (predicate=)"
            )
        raise ValueError(
            f"parameter {name!r} is already a DTensor with placements "
            f"{pl.summary()} ({pl.what()}): owner mode dedicates whole, plain matrices "
            f"and tensor-parallel shards over a dp × tp mesh. {how}"
        )
    for name, _, p in all_reduced:
        if is_dtensor(p) and crosses(p):
            pl = placement_of(p, name)
            raise ValueError(
                f"parameter {name!r} is a DTensor with placements {pl.summary()} laid out over "
                "the data-parallel ranks the dedication all-reduces over; all-reducing its "
                "local parts would mix different pieces of it. Dedicate the model before "
                "sharding it (fully_shard after dedicate, with fsdp.dedicate), or over a "
                "dp × tp mesh keep its placements on tp"
            )
