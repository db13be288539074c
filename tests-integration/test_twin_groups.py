"""DMuon's own communicators (``twin_groups``): one per live dedication, and made alike
on every rank whatever other process groups a rank holds.

* Two dedicated models trained together (backward of A, backward of B, then both
  steps, as a GAN or an encoder–decoder with an optimizer each), A leaving a layer
  unused on one rank: that rank holds A's reductions to the step while the other
  launches them in backward. On one shared communicator A's gradients were averaged
  with B's (both ranks equally wrong, silently) or the ranks waited for each other
  until the deadline. Each live dedication now reduces over a twin of its own; both
  models equal their one-process runs.
* An undedicated dedication gives its twin back: the next one over the same ranks
  reuses it, while two live ones hold two.
* One ``dist.new_group([0, 1])`` on four ranks (an evaluation group) made ranks 0–1
  hold one process group more than ranks 2–3, and torch names a subgroup made with
  ``use_local_synchronization`` by that count: the twin of the world or of a
  subgroup across them had two names, and ``DMuon(...)``/``dedicate()`` waited until
  the process group's timeout. Owner and replicated mode now train, and so do two
  overlapping subgroups on three ranks.
* A rank passing a subgroup it is not in is told so (torch gives it an int).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

OPT = dict(lr=0.02, weight_decay=0.1, ns_compute_dtype="float32", adamw_lr=3e-3, timeout=20.0)
STEPS = 3


class Branchy(nn.Module):
    """Two blocks, an optional ``extra`` layer and a head; ``seed`` picks the weights."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.extra = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        if use_extra:
            x = x + self.extra(x)
        return self.head(x)


def data(step: int, shard: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + 100 * step + shard)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def loss(model: nn.Module, step: int, shard: int, seed: int) -> torch.Tensor:
    x, y = data(step, shard, seed)
    # model A (seed 0) leaves `extra` unused on shard 1: its reductions wait for the step
    return F.mse_loss(model(x, use_extra=not (seed == 0 and shard == 1)), y)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def one_process(seed: int, shards: int) -> dict[str, torch.Tensor]:
    model = Branchy(seed)
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        (sum(loss(model, t, i, seed) for i in range(shards)) / shards).backward()
        opt.step()
        opt.zero_grad()
    return weights(model)


def _interleaved(rank: int, world: int, pack_mb: float) -> list[dict[str, torch.Tensor]]:
    from dmuon.integrations import ddp

    models = [Branchy(0), Branchy(1)]
    deds = [ddp.dedicate(m, layer_pack_mb=pack_mb) for m in models]
    opts = [DMuon(param_groups(m), distributed=d, **OPT) for m, d in zip(models, deds, strict=True)]
    for t in range(STEPS):
        for seed, model in enumerate(models):
            loss(model, t, rank, seed).backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
    for d in deds:
        d.wait()
    return [weights(m) for m in models]


@pytest.mark.parametrize("pack_mb", [1.0, 0])
def test_two_dedicated_models_trained_together_each_equal_their_one_process_run(pack_mb):
    world = 2
    expected = [one_process(0, world), one_process(1, world)]
    for rank, got in enumerate(run_on_ranks(_interleaved, world, args=(pack_mb,), timeout=120)):
        for seed in (0, 1):
            for name, value in expected[seed].items():
                diff = (got[seed][name] - value).abs().max().item()
                assert diff < 1e-5, f"rank {rank}, model {seed}, {name}: {diff}"


def _slots(rank: int, world: int) -> tuple[int, int, int, bool]:
    from dmuon.comm.process_groups import twin_slot
    from dmuon.integrations import ddp

    first = ddp.dedicate(Branchy(0))
    second = ddp.dedicate(Branchy(1))  # both alive: another twin
    a, b = twin_slot(first.exchange.group), twin_slot(second.exchange.group)
    group = first.exchange.group
    first.undedicate()  # on every rank: its twin is free again
    third = ddp.dedicate(Branchy(2))
    c = twin_slot(third.exchange.group)
    return a, b, c, third.exchange.group is group


def test_a_live_dedication_holds_its_twin_and_an_undedicated_one_gives_it_back():
    for a, b, c, same in run_on_ranks(_slots, 2, timeout=120):
        assert (a, b, c) == (0, 1, 0) and same, (a, b, c, same)


def _extra_group(rank: int, world: int, mode: str) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp

    dist.new_group([0, 1])  # every rank calls it (torch's rule); ranks 2, 3 are not in it
    model = Branchy(1)
    if mode == "owner":
        forward, opt = model, DMuon(param_groups(model), distributed=ddp.dedicate(model), **OPT)
    else:
        forward, opt = DDP(model), DMuon(param_groups(model), mode="replicated", **OPT)
    for t in range(STEPS):
        loss(forward, t, rank, 1).backward()
        opt.step()
        opt.zero_grad()
    opt.engine.settle()  # owner mode: the last step's publications landed
    return weights(model)


@pytest.mark.parametrize("mode", ["owner", "replicated"])
def test_a_process_group_some_ranks_hold_does_not_stop_dmuon_making_its_own(mode):
    world = 4
    expected = one_process(1, world)
    for rank, got in enumerate(run_on_ranks(_extra_group, world, args=(mode,), timeout=120)):
        for name, value in expected.items():
            diff = (got[name] - value).abs().max().item()
            assert diff < 1e-5, f"{mode}, rank {rank}, {name}: {diff}"


def _overlapping(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    from dmuon.integrations import ddp

    groups = {"A": dist.new_group([0, 1]), "B": dist.new_group([1, 2])}
    runs = []
    for name, seed in (("A", 1), ("B", 2)):
        g = groups[name]
        if rank in dist.get_process_group_ranks(g):
            model = Branchy(seed)
            opt = DMuon(param_groups(model), distributed=ddp.dedicate(model, g), **OPT)
            runs.append((name, seed, g, model, opt))
    for t in range(STEPS):
        for _, seed, g, model, _ in runs:
            loss(model, t, dist.get_rank(g), seed).backward()
        for *_, opt in runs:
            opt.step()
            opt.zero_grad()
    for *_, opt in runs:
        opt.engine.settle()
    return {name: weights(model) for name, _, _, model, _ in runs}


def test_two_overlapping_subgroups_train_their_models():
    """Rank 1 is in both subgroups (and trains both models), ranks 0 and 2 in one each."""
    expected = {"A": one_process(1, 2), "B": one_process(2, 2)}
    for rank, got in enumerate(run_on_ranks(_overlapping, 3, timeout=120)):
        assert sorted(got) == [["A"], ["A", "B"], ["B"]][rank], sorted(got)
        for name, params in got.items():
            for key, value in expected[name].items():
                diff = (params[key] - value).abs().max().item()
                assert diff < 1e-5, f"rank {rank}, model {name}, {key}: {diff}"


def _not_a_member(rank: int, world: int) -> list[str]:
    from dmuon.integrations import ddp

    sub = dist.new_group([0, 1])
    if rank < 2:
        return []
    said = []
    for make in (
        lambda: ddp.dedicate(Branchy(0), sub),
        lambda: DMuon(param_groups(Branchy(0)), mode="replicated", process_group=sub),
    ):
        try:
            make()
            said.append("accepted")
        except ValueError as err:
            said.append(str(err))
    return said


def test_a_rank_outside_the_group_it_is_given_is_told_so():
    out = run_on_ranks(_not_a_member, 4, timeout=120)
    for said in out[2:]:
        assert len(said) == 2, said
        for text in said:
            assert "this rank (global rank" in text and "is not a member" in text, text


def _dropped(rank: int, world: int) -> list[int]:
    import gc

    from dmuon.comm.process_groups import twin_slot
    from dmuon.integrations import ddp

    gc.disable()  # as some training loops run: a dropped dedication lives in its cycles
    try:
        slots = []
        for seed in range(6):
            ded = ddp.dedicate(Branchy(seed))
            slots.append(twin_slot(ded.exchange.group))
            del ded  # dropped without undedicate(): its model went with it
        return slots
    finally:
        gc.enable()


def test_a_dropped_dedication_gives_its_twin_back_to_the_next():
    """Without a collection the dropped one's weakref lived on, and each dedicate() took a
    new slot: a new communicator each time, until 64 were taken."""
    for slots in run_on_ranks(_dropped, 2, timeout=120):
        assert slots == [0] * 6, slots
