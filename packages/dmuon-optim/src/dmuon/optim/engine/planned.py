"""Shared by the modes that plan owners themselves (``replicated``, ``sharded``, ``sign``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dmuon.comm import CommHandle, CommStats, OwnerPlan, default_stats, plan_owners, wait_work
from dmuon.comm.faults import settle, stream_waits
from dmuon.comm.flags import flag_device
from dmuon.comm.plan_adoption import adopt_first_plan
from dmuon.comm.process_groups import group_size
from dmuon.optim.engine.base import Engine, Stepper, world_of
from dmuon.optim.engine.guards import guard_groups
from dmuon.optim.engine.layer_packing import DEFAULT_PACK_MB, check_pack_mb, pack_runs
from dmuon.optim.engine.model_agreement import check_model_consistency, plan_with_replicated
from dmuon.optim.engine.params import EngineParam, layers_in_order, subplan
from dmuon.optim.engine.report import StepReport

__all__ = ["Pipeline", "PlannedEngine"]


class Pipeline:
    """Handles in flight, at most ``depth`` of them: the oldest is finished first.

    Examples:
        >>> done = []
        >>> pipe = Pipeline(1)
        >>> pipe.push(CommHandle.done(1), done.append)
        >>> pipe.push(CommHandle.done(2), done.append)  # finishes the first
        >>> done
        [1]
        >>> pipe.drain()
        >>> done
        [1, 2]
    """

    def __init__(self, depth: int, report: StepReport | None = None) -> None:
        self.depth = depth
        self.report = report
        self._queue: deque[tuple[CommHandle[Any], Callable[[Any], None]]] = deque()

    def push(self, handle: CommHandle[Any], then: Callable[[Any], None]) -> None:
        """Add a handle; ``then(result)`` runs when it is finished."""
        self._queue.append((handle, then))
        while len(self._queue) > self.depth:
            self._pop()

    def _pop(self) -> None:
        handle, then = self._queue.popleft()
        if self.report is None:
            result = handle.wait()
        else:
            with self.report.phase("comm_wait"):
                result = handle.wait()
        then(result)

    def drain(self) -> None:
        """Finish every handle, oldest first."""
        while self._queue:
            self._pop()


class PlannedEngine(Engine):
    """An engine that plans owners for the matrix parameters over one process group.

    Attributes:
        carries_presence: whether the step reads which parameters have a gradient on
            some rank (:meth:`presence`): ``sharded`` and ``sign`` modes do; the flags then
            ride in the step's agreement (:meth:`begin_step_agreeing`).

    Args:
        group: the process group (``None``: the world).
        pipeline_depth: pipeline groups whose communication may be in flight at once.
        layer_pack_mb: consecutive layers whose matrices hold at most this many MiB
            together (whole, on one device) are one pipeline group: one collective and
            one batched rule call per shape for all of them, not one per layer
            (:func:`~dmuon.optim.engine.layer_packing.pack_runs`, owner mode's rule);
            ``0``: every layer alone. When a planned matrix is stepped on its shards
            (tensor or expert parallelism), no layer is packed.
        stats: where bytes are recorded.
        plan_options: passed to :func:`dmuon.comm.plan_owners`.
    """

    carries_presence: ClassVar[bool] = False

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        pipeline_depth: int = 2,
        layer_pack_mb: float = DEFAULT_PACK_MB,
        stats: CommStats | None = None,
        **plan_options: Any,
    ) -> None:
        super().__init__()
        self.group = group
        self.pipeline_depth = pipeline_depth
        self.layer_pack_bytes = check_pack_mb(layer_pack_mb)
        self.stats = stats if stats is not None else default_stats()
        self.plan_options = plan_options
        self.plan: OwnerPlan | None = None
        self.layers: list[str] = []
        self._subplans: dict[str, OwnerPlan] = {}
        self._owner: dict[int, int] = {}
        self._by_layer: dict[str, list[EngineParam]] = {}
        self._pack_of: dict[str, str] = {}  # a layer's pipeline group (its pack's key)
        self._guard_groups: list[dist.ProcessGroup | None] = []
        self._presence_at: int | None = None  # which guard group sums the presence flags
        self._carried: dict[str, bool] | None = None  # this step's, from its agreement

    def bind(self, stepper: Stepper) -> None:
        super().bind(stepper)
        self.rank, self.world_size = world_of(self.group)
        self.flag_device = flag_device(self.group)  # where the presence flags travel
        matrices = [e for e in self.params if self.planned(e)]
        self.plan = plan_owners([e.item for e in matrices], self.world_size, **self.plan_options)
        self._pack(matrices)
        if self.world_size > 1:  # a group of one (dp = 1 on a dp × tp mesh): nothing to agree
            # an ILP plan made under a wall-clock limit can differ between ranks: every
            # rank takes the first one's (only a fingerprint travels when they agree)
            self.plan = adopt_first_plan(self.plan, [self.group])
            # each matrix's unit too: ranks that pack otherwise (another layer_pack_mb)
            # would issue other collectives
            unit_of = {e.name: self._pack_of[e.layer] for e in matrices}
            check_model_consistency(
                plan_with_replicated(self.checked_plan(), (), unit_of), self.group
            )
        for key in self.layers:
            self._subplans[key] = subplan(self.plan, [e.name for e in self._by_layer[key]])
        self._owner = {id(e.param): self.plan.owner(e.name) for e in matrices}
        # DDP, FSDP2 or the training loop use these groups too: the guards' flags go
        # over twins, so a rank that is in another collective is never matched with them.
        self._guard_groups = guard_groups(self.agreement_groups())
        self._presence_at = self._presence_group() if self.carries_presence else None

    def _pack(self, matrices: list[EngineParam]) -> None:
        """The pipeline groups: the layers in natural order, consecutive small ones packed
        (:attr:`layer_pack_bytes`), each with its matrices in group order.

        Every rank cuts the same packs: by the whole matrices' bytes (the plan's items),
        not this rank's shards, which differ between ranks where rows do not divide
        evenly. A pack is keyed ``first..last`` of its layers, as owner mode's."""
        by_layer: dict[str, list[EngineParam]] = {key: [] for key in layers_in_order(matrices)}
        for e in matrices:  # once here, read by every step's layers
            by_layer[e.layer].append(e)
        limit = self.layer_pack_bytes
        if any(self.on_shard(e.param) for e in matrices):
            limit = 0  # stepped on their tensor- or expert-parallel shards: layers alone
        runs = pack_runs(
            [
                (key, sum(e.item.nbytes for e in es), es[0].param.device)
                for key, es in by_layer.items()
            ],
            limit,
        )
        self.layers = [run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs]
        self._pack_of, self._by_layer = {}, {}
        for run, key in zip(runs, self.layers, strict=True):
            self._pack_of.update(dict.fromkeys(run, key))
            self._by_layer[key] = [e for layer in run for e in by_layer[layer]]

    def _presence_group(self) -> int | None:
        """The index of the guard group whose ranks are :attr:`group`'s, if there is one
        and :attr:`group` has more than one rank: the presence flags are summed over it
        inside the step's agreement (:meth:`begin_step_agreeing`); ``None``: they keep
        their own all-reduce (:meth:`agree_presence`).

        Every rank of that guard group decides alike: the groups are blocks of the same
        mesh dimensions on every rank, so when this rank's :attr:`group` is the block of
        guard group ``i`` holding it, every rank of that block finds the same ``i``."""
        if group_size(self.group) < 2:
            return None
        mine = set(
            dist.get_process_group_ranks(dist.group.WORLD if self.group is None else self.group)
        )
        for i, g in enumerate(self._guard_groups):
            ranks = dist.get_process_group_ranks(dist.group.WORLD if g is None else g)
            if set(ranks) == mine:
                return i
        return None

    def begin_step(self) -> None:
        self._carried = None  # a new step: whatever an earlier one left is not this one's
        super().begin_step()

    def skip_step(self) -> None:
        super().skip_step()
        self._carried = None  # a refused or skipped step leaves none for the next

    def discard_grads(self) -> None:
        super().discard_grads()
        self._carried = None

    def begin_step_agreeing(
        self, slots: Callable[[frozenset[int]], torch.Tensor]
    ) -> torch.Tensor | None:
        """Begin the step and sum the step's agreement with the gradient-presence flags
        in one all-reduce (``sharded``, ``sign``: :attr:`carries_presence`), as owner mode
        carries the agreement in its flush's flags
        (:meth:`~dmuon.optim.engine.reduction.Reduction.flush`): one small all-reduce a
        step where there were two (and a host read each).

        The slots ``slots(frozenset())`` (nothing vouched finite here) come first, then
        one ``int64`` flag per parameter, by name (the ranks may list the same parameters
        in different orders), read after :meth:`begin_step` as :meth:`agree_presence`
        read them in the step: nothing between the agreement and the step changes a
        gradient. The slots are summed over every guard group in turn, as
        :func:`~dmuon.optim.engine.guards.agree_step` sums them; the flags only in the
        all-reduce over the guard group with :attr:`group`'s ranks (HSDP, FSDP2 over
        tensor parallelism: the others carry the slots alone), so each flag counts the
        ranks of :attr:`group` as before. :meth:`presence` gives them to the step.

        Returns:
            The slots summed (a host tensor: the flags were read once), or ``None`` when
            nothing was carried (this mode reads no presence, or no guard group has
            :attr:`group`'s ranks): the agreement then sums its slots itself.
        """
        self.begin_step()
        at = self._presence_at
        if at is None:
            return None
        agreement = slots(frozenset()).to(self.flag_device)
        params = sorted(self.params, key=lambda e: e.name)
        local = [int(e.param.grad is not None) for e in params]
        k = agreement.numel()
        flags = torch.cat(
            [agreement, torch.tensor(local, dtype=torch.int64, device=agreement.device)]
        )
        groups = self._guard_groups
        for i, g in enumerate(groups):
            n = group_size(g)
            if i == at:
                what = "all-reduce of the step's agreement and gradient-presence flags"
                wait_work(dist.all_reduce(flags, group=g, async_op=True), what, g)
                self.stats.record_collective(
                    "presence_flags", "all_reduce", nbytes=flags.nbytes, world_size=n
                )
            else:  # the slots alone (a contiguous view: summed in place)
                what = "all-reduce of the step's agreement"
                wait_work(dist.all_reduce(flags[:k], group=g, async_op=True), what, g)
        # the deadline of the collectives left to the stream (NCCL), checked before the
        # host read; waited for when the flags' own all-reduce was (the read waits anyway)
        settle(wait=any(stream_waits(g, flags.device) for g in groups))
        summed = flags.tolist()
        self._carried = {e.name: bool(f) for e, f in zip(params, summed[k:], strict=True)}
        # on the host: the agreement need not read the device again
        return torch.tensor(summed[:k], dtype=torch.int64)

    def presence(self) -> dict[str, bool]:
        """Which parameters have a gradient on at least one rank of :attr:`group`, for
        this step: carried in its agreement (:meth:`begin_step_agreeing`), else
        :meth:`agree_presence` (one all-reduce more)."""
        carried, self._carried = self._carried, None
        return carried if carried is not None else self.agree_presence()

    def guard_groups(self) -> list[dist.ProcessGroup | None]:
        return self._guard_groups

    def checked_plan(self) -> OwnerPlan:
        """What every rank must hold alike, before the first collective
        (:func:`~dmuon.optim.engine.model_agreement.check_model_consistency`): the planned
        matrices; an engine that synchronises more itself adds those."""
        assert self.plan is not None
        return self.plan

    def planned(self, e: EngineParam) -> bool:
        """Whether ``e`` is given an owner: every matrix parameter (an engine may step some
        where they are instead, e.g. ``sharded`` mode's whole experts)."""
        return e.matrix

    def matrices(self, key: str | None = None) -> list[EngineParam]:
        """The planned matrix parameters (of layer ``key``), in group order."""
        if key is None:
            return [e for e in self.params if self.planned(e)]
        return list(self._by_layer.get(key, ()))

    def owner_of(self, p: torch.Tensor) -> int | None:
        """The owner of matrix parameter ``p`` (``None``: not a planned matrix)."""
        return self._owner.get(id(p))

    def steps(self, p: torch.Tensor) -> bool:
        owner = self.owner_of(p)
        return owner is None or owner == self.rank

    def step_groups(self) -> list[str | None]:
        return [*self.layers, None]

    def group_of(self, p: torch.Tensor) -> str | None:
        e = self.info(p)
        return self._pack_of.get(e.layer, e.layer) if e is not None and e.matrix else None

    def agree_presence(self, extra: list[EngineParam] | None = None) -> dict[str, bool]:
        """Which parameters have a gradient on at least one rank (one small all-reduce)."""
        # by name: the ranks may list the same parameters in different orders
        params = sorted(self.params if extra is None else extra, key=lambda e: e.name)
        flags = torch.tensor(
            [int(e.param.grad is not None) for e in params],
            dtype=torch.int32,
            device=self.flag_device,
        )
        n = group_size(self.group)
        if n > 1:
            wait_work(
                dist.all_reduce(flags, group=self.group, async_op=True),
                "all-reduce of gradient-presence flags",
                self.group,
            )
            self.stats.record_collective(
                "presence_flags", "all_reduce", nbytes=flags.nbytes, world_size=n
            )
        # the deadline of the collectives left to the stream (NCCL), before the host read
        settle(wait=n > 1 and stream_waits(self.group, flags.device))
        return {e.name: bool(f) for e, f in zip(params, flags.tolist(), strict=True)}

    def agreement_groups(self) -> list[dist.ProcessGroup | None]:
        return [self.group] if self.world_size > 1 else []

    def planning_groups(self) -> list[dist.ProcessGroup | None]:
        return [self.group]

    def subplan(self, key: str) -> OwnerPlan:
        """The plan of layer ``key``'s matrices."""
        return self._subplans[key]

    def describe(self) -> dict[str, Any]:
        assert self.plan is not None
        return {
            "mode": self.mode,
            "world_size": self.world_size,
            "rank": self.rank,
            "plan_digest": self.plan.digest(),
            "owners": dict(zip(self.plan.names, self.plan.owners, strict=True)),
        }
