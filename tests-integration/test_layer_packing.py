"""Owner mode packs consecutive small layers into one unit of reduction and publication.

On a model of many small layers the collectives' latency, not their bytes, bounds the
owner-mode step (three collectives per layer: the reduction to the owners, the
scalars' all-reduce, the publication). ``layer_pack_mb`` (default 1 MiB, DDP's first
bucket) packs consecutive layers, in natural order, while their parameters hold at
most that many MiB: one collective per owner and pack.

Checked here: the greedy packing by bytes against a hand count; two gloo ranks with
packing give the single-process result of the same global batch and exactly the
unpacked owner mode's weights, with the collectives counted per pack; a pack's
forward pre-hooks wait for the whole pack before whichever of its layers runs first
(a model whose forward order is not its names' order); ZeRO-3-like stays one layer a
unit; bad values are refused naming the argument.
"""

import contextlib

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim.engine.layer_record import OwnerLayer, pack_layers

WIDTH = 8
DEPTH = 6
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.linear(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def batch(step: int) -> torch.Tensor:
    """The global batch of a step (4 rows; rank r of 2 takes rows 2r, 2r+1)."""
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 + step))


def test_pack_layers_is_greedy_by_bytes_in_natural_order():
    sizes = [4, 4, 4, 16, 2, 2]  # float32 elements: 16, 16, 16, 64, 8, 8 bytes
    params = {f"l.{i}.w": torch.zeros(n) for i, n in enumerate(sizes)}
    layers = [OwnerLayer(f"l.{i}", replicated=[f"l.{i}.w"]) for i in range(len(sizes))]
    layer_of = {f"l.{i}.w": f"l.{i}" for i in range(len(sizes))}
    packed, of = pack_layers(layers, params, layer_of, 32)
    # 16+16 = 32 fits; +16 does not; 64 alone (over the limit); 8+8 fits
    assert [p.members for p in packed] == [("l.0", "l.1"), ("l.2",), ("l.3",), ("l.4", "l.5")]
    assert [p.key for p in packed] == ["l.0..l.1", "l.2", "l.3", "l.4..l.5"]
    assert packed[0].replicated == ["l.0.w", "l.1.w"] and packed[0].expected == 2
    assert of["l.1.w"] == "l.0..l.1" and of["l.2.w"] == "l.2" and of["l.5.w"] == "l.4..l.5"
    unpacked, same = pack_layers(layers, params, layer_of, 0)
    assert [p.key for p in unpacked] == [f"l.{i}" for i in range(6)] and same == layer_of
    with pytest.raises(ValueError, match="max_bytes"):
        pack_layers(layers, params, layer_of, -1)


@pytest.mark.parametrize("bad", [-1, "1", True, float("nan")])
def test_a_bad_pack_size_is_refused_naming_it(bad):
    from dmuon.integrations import ddp

    with pytest.raises(ValueError, match="layer_pack_mb"):
        ddp.dedicate(Stack(), layer_pack_mb=bad)


def test_zero3_like_keeps_one_layer_a_unit():
    from dmuon.integrations import fsdp

    ded = fsdp.dedicate(Stack(), reshard_after_forward=True)
    assert ded.exchange.layer_keys() == [f"blocks.{i}" for i in range(DEPTH)]
    packed = fsdp.dedicate(Stack())
    assert packed.exchange.layer_keys() == [f"blocks.0..blocks.{DEPTH - 1}"]


def _train(rank, world, pack_mb):
    from dmuon.comm import CommStats
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    model = Stack()
    stats = CommStats()
    ded = ddp.dedicate(model, layer_pack_mb=pack_mb, stats=stats)
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02, ns_compute_dtype="float32")
    calls = []
    for t in range(STEPS):
        x = batch(t)[2 * rank : 2 * rank + 2]
        stats.reset()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ded.wait()
        calls.append(
            (stats["reduce_to_owners"].collectives, stats["broadcast_from_owners"].collectives)
        )
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, calls, ded.exchange.layer_keys()


def test_two_ranks_packed_equal_unpacked_and_one_process():
    from dmuon.optim import DMuon, param_groups

    packed = run_on_ranks(_train, 2, args=(1.0,), timeout=120)
    unpacked = run_on_ranks(_train, 2, args=(0,), timeout=120)
    model = Stack()
    opt = DMuon(param_groups(model), lr=0.02, ns_compute_dtype="float32")
    for t in range(STEPS):
        # DDP's loss: each rank's mean over its half; the gradient average is the
        # mean over the whole batch
        model(batch(t)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    (w0, calls, keys), (w1, _, _) = packed
    assert keys == [f"blocks.0..blocks.{DEPTH - 1}"]
    assert unpacked[0][2] == [f"blocks.{i}" for i in range(DEPTH)]
    for name, p in model.named_parameters():
        assert torch.equal(w0[name], w1[name]), name  # the ranks agree bit for bit
        assert torch.equal(w0[name], unpacked[0][0][name]), name  # as unpacked
        torch.testing.assert_close(w0[name], p.detach(), rtol=0, atol=1e-6)
    # per step: one reduce and one broadcast per owner holding a matrix of the pack,
    # against one per layer unpacked
    owners = 2
    assert calls == [(owners, owners)] * STEPS
    assert unpacked[0][1] == [(DEPTH, DEPTH)] * STEPS


def test_the_planner_counts_the_collectives_of_the_packs():
    from dmuon.comm import plan_owners
    from dmuon.optim.planner.config import spec_from_module
    from dmuon.optim.planner.traffic import dmuon_transfers

    spec = spec_from_module(Stack(), "stack")
    plan = plan_owners(spec.matrices, 2)

    def issued(mode):
        ts = dmuon_transfers(spec, plan, mode)
        return {t.op: (t.collectives, t.rounds) for t in ts if t.op != "presence_flags"}

    # one unit (the matrices of the six layers hold 1.5 KiB): a reduce and a broadcast
    # per owner, one round of latency, as test_two_ranks_packed... records
    assert issued("owner") == {"reduce_to_owners": (2, 1), "broadcast_from_owners": (2, 1)}
    # ZeRO-3-like: a unit per layer, each layer's matrix one collective, twice broadcast
    assert issued("owner-z3") == {
        "reduce_to_owners": (DEPTH, DEPTH),
        "broadcast_from_owners": (DEPTH, DEPTH),
    }


class Reordered(nn.Module):
    """Layers named against their forward order: ``z`` runs before ``a``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.z = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.z(x)))


def _first_layer_to_run_waits(rank, world):
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    model = Reordered()
    ded = ddp.dedicate(model)
    keys = ded.exchange.layer_keys()
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02)
    model(batch(0)).square().mean().backward()
    opt.step()
    publication = ded.exchange.publication
    pending = publication.pending_publications()
    model.z(batch(1))  # the pack is a..z: z, its last member, runs first
    return keys, pending, publication.pending_publications()


def test_the_first_layer_of_a_pack_to_run_waits_for_the_whole_pack():
    for keys, pending, after in run_on_ranks(_first_layer_to_run_waits, 2, timeout=120):
        assert keys == ["a..z"]
        assert pending == ["a..z"] and after == []


# --------------------------------------------------------------------------- defects
# Found by an adversarial review of packing; each test below failed before its fix.


def test_layers_on_different_devices_are_packed_apart():
    # A pack's buffers live on one device (its first parameter's). Before, two small
    # layers on different devices were packed together and the second one's weights
    # could not be made views of the pack's buffer: "dedicated parameter 'l.1.w' is on
    # meta but was dedicated on cpu". The meta device stands in for a second device (no
    # accelerator in CI): the exchange only allocates on it.
    from dmuon.comm import MatrixItem, plan_owners
    from dmuon.optim import OwnerExchange

    devices = ["cpu", "cpu", "meta", "meta", "cpu"]
    items = [MatrixItem(f"l.{i}.w", (4, 4), layer=f"l.{i}") for i in range(len(devices))]
    params = [nn.Parameter(torch.ones(4, 4, device=d)) for d in devices]
    ex = OwnerExchange(list(zip(items, params, strict=True)), plan=plan_owners(items, 1))
    assert ex.layer_keys() == ["l.0..l.1", "l.2..l.3", "l.4"]
    for i, d in enumerate(devices):
        assert ex.param(f"l.{i}.w").device.type == d
        (bucket,) = ex.layer(f"l.{i}").publish_buckets
        assert bucket.buffer.device.type == d


def test_an_unbounded_pack_size_packs_every_layer():
    # float("inf"): no limit. Before: OverflowError (int() of an infinite byte count).
    from dmuon.integrations import ddp

    ded = ddp.dedicate(Stack(), layer_pack_mb=float("inf"))
    assert ded.exchange.layer_keys() == [f"blocks.0..blocks.{DEPTH - 1}"]


def test_deepspeed_zero_stages_pass_the_pack_size_on():
    # DeepSpeed ZeRO 1/2 in owner mode build the dedication themselves from
    # dedicate_options; before, layer_pack_mb went on to plan_owners: TypeError.
    from dmuon.integrations.deepspeed import _dedicate, _owner_client
    from dmuon.optim import param_groups

    unpacked, packed = ["blocks.0", "blocks.1"], ["blocks.0..blocks.1"]
    for options, keys in (({"layer_pack_mb": 0}, unpacked), ({}, packed)):
        model = Stack()
        del model.blocks[2:]
        groups = param_groups(model)
        client = _owner_client(groups, _dedicate(model, groups, 2, {}, options), {})
        assert client.dmuon.engine.exchange.layer_keys() == keys


def _packs_differently(rank, world):
    from dmuon.integrations import ddp
    from dmuon.optim import ModelMismatchError

    try:
        ddp.dedicate(Stack(), layer_pack_mb=1.0 if rank == 0 else 0)
    except ModelMismatchError as err:
        return str(err)
    return None


def test_ranks_that_pack_differently_are_told_on_every_rank_before_any_reduction():
    # Before: the ranks' buckets differed in size and gloo aborted rank 1 in the first
    # broadcast ("Received data size doesn't match expected size"; NCCL would hang or
    # mix the buffers). Now the model check, which compares each parameter's unit,
    # raises on every rank, naming the parameter, both units and the argument.
    for text in run_on_ranks(_packs_differently, 2, timeout=60):
        assert text is not None
        assert "rank 1 has parameter 'blocks.0.linear.weight' in layer 'blocks.0', " in text
        assert f"rank 0 in 'blocks.0..blocks.{DEPTH - 1}'" in text
        assert "layer_pack_mb" in text


def _waits_by_a_packed_layer_key(rank, world):
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    model = Stack()
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02)
    model(batch(0)[2 * rank : 2 * rank + 2]).square().mean().backward()
    reduction, publication = ded.exchange.reduction, ded.exchange.publication
    reduction.flush()
    reduction.wait_reduced("blocks.2")  # a layer's key: its pack's reductions
    reduced = ded.exchange.layer("blocks.0").reduced
    reduction.wait_all_reduced()
    reduction.end_step()
    opt.zero_grad()
    model(batch(1)[2 * rank : 2 * rank + 2]).square().mean().backward()
    opt.step()
    pending = publication.pending_publications()
    publication.wait_published("blocks.3")  # a layer's key: its pack's publication
    return reduced, pending, publication.pending_publications()


def test_the_exchange_sides_take_the_key_of_a_packed_layer():
    # exchange.layer("blocks.3") finds the pack; the reduction's and the publication's
    # waits by a layer key (public API, exchange.reduction / exchange.publication) did
    # not: KeyError 'blocks.2'. They now act on the layer's pack.
    for reduced, pending, after in run_on_ranks(_waits_by_a_packed_layer_key, 2, timeout=60):
        assert reduced
        assert pending == [f"blocks.0..blocks.{DEPTH - 1}"] and after == []


# ------------------------------------------------------- scenarios that hold (kept)


class Branchy(nn.Module):
    """Small layers, one pack: ``extra`` runs on some ranks or micro-batches only,
    ``idle`` on none; ``w`` is held by the root (its key names no module)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a = nn.Linear(WIDTH, WIDTH)
            self.extra = nn.Linear(WIDTH, WIDTH)
            self.idle = nn.Linear(WIDTH, WIDTH)
            self.b = nn.Linear(WIDTH, WIDTH)
            self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return torch.tanh(self.b(h)) @ self.w


def _uses_extra(case: str, rank: int, micro: int) -> bool:
    # "partial": rank 0 only; "no_sync": rank 1, in the micro-batch run inside no_sync()
    # only (the reducing one does not reach it)
    return rank == 0 if case == "partial" else (rank == 1 and micro == 0)


def _rows(step: int, micro: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + micro))


def _branchy(rank, world, case, pack_mb):
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    model = Branchy()
    ded = ddp.dedicate(model, layer_pack_mb=pack_mb)
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02, ns_compute_dtype="float32")
    micros = 2 if case == "no_sync" else 1
    for t in range(STEPS):
        for micro in range(micros):
            x = _rows(t, micro)[2 * rank : 2 * rank + 2]
            with ded.no_sync() if micro < micros - 1 else contextlib.nullcontext():
                loss = model(x, _uses_extra(case, rank, micro)).square().mean() / micros
                loss.backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, ded.exchange.layer_keys()


@pytest.mark.parametrize("case", ["partial", "no_sync"])
def test_a_layer_some_ranks_skip_inside_a_pack_steps_as_one_process(case):
    # The pack completes on the ranks that used every layer and is launched by the
    # flush on the others (the flags on their own communicator); `idle` has no
    # gradient anywhere and is not stepped. Packed = unpacked bit for bit (2 ranks), and
    # = one process on the global batch (the mean of the ranks' losses) to fp32 rounding.
    from dmuon.optim import DMuon, param_groups

    packed = run_on_ranks(_branchy, 2, args=(case, 1.0), timeout=60)
    unpacked = run_on_ranks(_branchy, 2, args=(case, 0), timeout=60)
    model = Branchy()
    opt = DMuon(param_groups(model), lr=0.02, ns_compute_dtype="float32")
    micros = 2 if case == "no_sync" else 1
    for t in range(STEPS):
        for micro in range(micros):
            for r in range(2):
                x = _rows(t, micro)[2 * r : 2 * r + 2]
                (model(x, _uses_extra(case, r, micro)).square().mean() / micros / 2).backward()
        opt.step()
        opt.zero_grad()
    assert packed[0][1] == ["a..w"] and len(unpacked[0][1]) == 5
    for name, p in model.named_parameters():
        for rank in range(2):
            assert torch.equal(packed[rank][0][name], unpacked[rank][0][name]), (rank, name)
        torch.testing.assert_close(packed[0][0][name], p.detach(), rtol=0, atol=1e-6)
    assert torch.equal(packed[0][0]["idle.weight"], Branchy().idle.weight.detach())


def _checkpointed(rank, world, root, pack_mb, save):
    """Train steps 0-1 and save (``save``), or load; then steps 2-3, on the global batch
    of 12 rows split over the ranks."""
    import torch.distributed as dist

    from dmuon.integrations import checkpoint, ddp
    from dmuon.optim import DMuon, param_groups

    model = Branchy()
    ded = ddp.dedicate(model, layer_pack_mb=pack_mb)
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02, ns_compute_dtype="float32")

    def train(steps):
        n = 12 // world
        for t in steps:
            x = torch.randn(12, WIDTH, generator=torch.Generator().manual_seed(t))
            model(x[rank * n : (rank + 1) * n], True).square().mean().backward()
            opt.step()
            opt.zero_grad()

    if save:
        train(range(2))
        checkpoint.save(root, model, opt)
    else:
        checkpoint.load(root, model, opt)
    train(range(2, 4))
    ded.wait()
    dist.barrier()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_checkpoint_saved_packed_resumes_unpacked_and_at_another_world_size(tmp_path):
    # The optimizer state is kept by parameter, not by unit: a packed run's checkpoint
    # resumes unpacked (bit for bit on 2 ranks) and packed on 3 ranks (other sums over
    # the ranks: fp32 rounding).
    packed = str(tmp_path / "packed")
    want = run_on_ranks(_checkpointed, 2, args=(packed, 1.0, True), timeout=60)[0]
    got = run_on_ranks(_checkpointed, 2, args=(packed, 0, False), timeout=60)[0]
    for name in want:
        assert torch.equal(got[name], want[name]), name
    got = run_on_ranks(_checkpointed, 3, args=(packed, 1.0, False), timeout=60)[0]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
