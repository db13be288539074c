"""Where owner mode waits for a layer's published weights, and what it does when a forward
goes past that wait.

A layer key names a module (``blocks.3``); its forward pre-hook waits for the layer's
broadcast from its owners. When the key names a container that a forward iterates and
never calls (a ``ModuleList`` of blocks inside a ``ModuleList`` of stages), the waits go
on the first modules below it that the forward does call; ZeRO-3-like, which frees a
layer after its module's forward, refuses such a layer. The waits run before the model's
own pre-hooks. A gradient of a layer whose broadcast was still in flight after the
forward (a forward run past the hooks) is refused on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm import layer_key
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 2
STEPS = 4
OPT = dict(lr=0.02, weight_decay=0.01, momentum=0.9, ns_compute_dtype=torch.float32)
TOLERANCE = 2e-6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12, bias=False)
        self.fc2 = nn.Linear(12, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Staged(nn.Module):
    """Two stages of blocks, each a ``ModuleList`` inside ``stages``: ``layer_key`` names
    the stage (``stages.0``), a list the forward iterates. ``past_hooks``: the last
    stage's block is run by its ``forward`` method, past its module hooks."""

    def __init__(self, past_hooks: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList([nn.ModuleList([Block(), Block()]), nn.ModuleList([Block()])])
        self.past_hooks = past_hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                last = block is self.stages[-1][-1]
                x = block.forward(x) if self.past_hooks and last else block(x)
        return x


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def train_step(model: nn.Module, opt: DMuon, step: int, rank: int, world: int) -> None:
    x, y = batch(step)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()
    opt.zero_grad()


class Attending(nn.Module):
    """A linear layer, then an ``nn.MultiheadAttention`` outside any numbered block:
    ``layer_key`` gives ``pool.out_proj`` for its output projection, a module the
    attention never calls (it reads ``out_proj.weight`` in its functional attention). Each
    row is a sequence of one token, so that rows do not mix."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6, bias=False)
        self.pool = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).unsqueeze(1)
        return self.pool(h, h, h, need_weights=False)[0].squeeze(1)


def one_process(make: type[nn.Module] = Staged) -> dict[str, torch.Tensor]:
    model = make()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        train_step(model, opt, t, 0, 1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_containers(rank, world):
    """ZeRO-2-like ``ddp.dedicate`` of :class:`Staged`, every layer alone: a pre-hook of
    the model's own, on each block and registered before ``dedicate``, records whether its
    layer's broadcast was still in flight when it ran."""
    from dmuon.integrations import ddp

    model = Staged()
    seen: list[bool] = []
    for i, stage in enumerate(model.stages):
        for block in stage:
            block.register_forward_pre_hook(
                lambda *_, key=f"stages.{i}": seen.append(
                    key in ded.exchange.publication.pending_publications()
                )
            )
    ded = ddp.dedicate(model, layer_pack_mb=0)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    for t in range(STEPS):
        train_step(model, opt, t, rank, world)
    ded.wait()
    waited = sorted(
        name
        for name, m in model.named_modules()
        if any(h.__name__ == "hook" for h in m._forward_pre_hooks.values())
    )
    return seen, waited, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_layer_named_by_a_list_of_blocks_waits_before_each_block_like_one_process():
    """Layer ``stages.0`` is a ``ModuleList`` no forward calls: its wait is on its blocks
    (the first to run waits, the next finds it done), before the model's own pre-hooks; the
    weights each block reads are current, so training equals one process (on the code
    before, the stages read last step's weights and it did not)."""
    want = one_process()
    for rank, (seen, waited, got) in enumerate(run_on_ranks(run_containers, WORLD, timeout=120)):
        assert waited == ["stages.0.0", "stages.0.1", "stages.1.0"], (rank, waited)
        assert seen == [False] * 3 * STEPS, f"rank {rank}: a block ran before its wait: {seen}"
        for name, w in want.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_attending(rank, world):
    from dmuon.integrations import ddp

    model = Attending()
    ded = ddp.dedicate(model, layer_pack_mb=0)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    for t in range(STEPS):
        train_step(model, opt, t, rank, world)
    ded.wait()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_an_attention_modules_output_projection_waits_before_the_attention_runs():
    """``pool.out_proj`` is never called: its wait goes on the attention module (before,
    the wait sat on ``out_proj`` and never ran: the other ranks read last step's weight,
    and once it was checked every step after the first was refused)."""
    want = one_process(Attending)
    assert "pool.out_proj.weight" in want
    for rank, got in enumerate(run_on_ranks(run_attending, WORLD, timeout=120)):
        for name, w in want.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_zero3(rank, world):
    from dmuon.integrations import ddp

    model = Staged()
    try:
        ddp.dedicate(model, reshard_after_forward=True)
        refused = None
    except ValueError as err:
        refused = str(err)
    # each parameter's layer its block: one module per layer, taken and trained
    blocks = {".".join(n.split(".")[:3]) for n, _ in model.named_parameters()}

    def block_of(name: str) -> str:
        return next((b for b in blocks if name.startswith(b + ".")), layer_key(name))

    # a backward pre-hook of the model's own on each block, registered before dedicate():
    # whether any weight of the block was freed when it ran
    freed: list[bool] = []
    for b in sorted(blocks):
        model.get_submodule(b).register_full_backward_pre_hook(
            lambda *_, b=b: freed.append(
                any(n.startswith(b + ".") for n in ded.exchange.publication.released_names())
            )
        )
    ded = ddp.dedicate(model, reshard_after_forward=True, layer_of=block_of)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    for t in range(STEPS):
        train_step(model, opt, t, rank, world)
    ded.wait()
    return refused, freed, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_zero3_like_refuses_a_layer_of_several_blocks_and_takes_one_block_per_layer():
    """ZeRO-3-like frees a layer after its module's forward: a layer of two blocks would be
    freed after the first. ``dedicate`` refuses it on every rank, naming the layer and the
    modules, before any weight is freed; with ``layer_of`` naming the blocks it trains like
    one process, and a backward pre-hook of the model's own reads the gathered weights."""
    want = one_process()
    for rank, (refused, freed, got) in enumerate(run_on_ranks(run_zero3, WORLD, timeout=120)):
        # the re-gather before each block's backward runs before the model's own pre-hook
        assert freed == [False] * 3 * STEPS, f"rank {rank}: freed at a backward: {freed}"
        assert refused is not None, f"rank {rank}: a layer of two blocks was taken"
        assert "'stages.0'" in refused and "['stages.0.0', 'stages.0.1']" in refused, refused
        assert "layer_of=" in refused, refused
        for name, w in want.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def run_past_hooks(rank, world):
    """The second forward runs the last block past its hooks (its layer's broadcast in
    flight on rank 1; landed on rank 0 by a ``state_dict()`` there alone); after
    ``zero_grad()`` the training goes on with the hooks."""
    from dmuon.integrations import ddp

    model = Staged()
    ded = ddp.dedicate(model, layer_pack_mb=0)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    train_step(model, opt, 0, rank, world)
    if rank == 0:  # lands every broadcast on rank 0 alone: the refusal must not change
        model.state_dict()
    model.past_hooks = True
    x, y = batch(1)
    try:
        F.mse_loss(model(x), y).backward()
        err = None
    except RuntimeError as e:
        err = str(e)
    opt.zero_grad()  # drops the iteration
    model.past_hooks = False
    for t in range(1, STEPS):
        train_step(model, opt, t, rank, world)
    ded.wait()
    return err, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_forward_past_a_layers_hooks_is_refused_on_every_rank():
    """Refused on both ranks alike, though rank 0 alone had landed the weights (a
    refusal on one rank only would leave the other waiting in the step's collectives)."""
    results = run_on_ranks(run_past_hooks, WORLD, timeout=120)
    for rank, (err, _) in enumerate(results):
        assert err is not None and "it was not called since" in err, (rank, err)
        assert "layer 'stages.1'" in err and "'stages.1.0.fc" in err, (rank, err)
    for name, want in results[0][1].items():
        assert torch.equal(results[1][1][name], want), name


def two_backwards(model: Staged, opt: DMuon, step: int, rank: int, world: int) -> None:
    """One step of two losses, each with its own backward: the first stage's output, then
    the last stage's on it detached (disjoint layers, each reduced once)."""
    x, y = batch(step)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    h = x[rows]
    for block in model.stages[0]:
        h = block(h)
    F.mse_loss(h, y[rows]).backward()
    out = model.stages[1][0](h.detach())
    F.mse_loss(out, y[rows]).backward()
    opt.step()
    opt.zero_grad()


def run_two_backwards(rank, world):
    from dmuon.integrations import ddp

    model = Staged()
    ded = ddp.dedicate(model, layer_pack_mb=0)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    for t in range(STEPS):
        two_backwards(model, opt, t, rank, world)
    ded.wait()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_two_forwards_and_backwards_in_a_step_are_not_refused():
    """The second forward runs after the first backward (whose first gradient landed every
    broadcast), through its hooks: nothing is refused, and the steps equal one process."""
    model = Staged()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(STEPS):
        two_backwards(model, opt, t, 0, 1)
    for rank, got in enumerate(run_on_ranks(run_two_backwards, WORLD, timeout=120)):
        for name, p in model.named_parameters():
            diff = (got[name] - p.detach()).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


@pytest.mark.parametrize(
    ("keys", "names", "want"),
    [
        (["blocks.1"], ["blocks.1.fc.weight"], ["blocks.1"]),
        # a list of blocks: each block on the way to a parameter
        (
            ["stages.0"],
            ["stages.0.1.fc.weight", "stages.0.0.fc.weight"],
            ["stages.0.0", "stages.0.1"],
        ),
        # a parameter list held by a block: the block
        (["blocks.0.experts"], ["blocks.0.experts.0"], ["blocks.0"]),
        # a module without a forward (a namespace the forward reaches into): its blocks
        (
            ["groups.0"],
            ["groups.0.first.fc.weight", "groups.0.second.fc.weight"],
            ["groups.0.first", "groups.0.second"],
        ),
        # a custom key that names no module: where its weights meet (a list: its blocks)
        (["pair"], ["blocks.0.fc.weight", "blocks.1.fc.weight"], ["blocks.0", "blocks.1"]),
        (["blocks.0.pair"], ["blocks.0.fc.weight"], ["blocks.0.fc"]),
        (["out"], ["attn.out_proj.weight"], ["attn"]),
        # a parameter of the model itself
        (["scale"], ["scale"], [""]),
        # the out_proj of an attention module, which reads its weight without calling it
        (["attn.out_proj"], ["attn.out_proj.weight"], ["attn"]),
        (["mine.out_proj"], ["mine.out_proj.weight"], ["mine"]),  # a subclass
        (["blocks.1"], ["blocks.1.attn.out_proj.weight"], ["blocks.1"]),
    ],
)
def test_layer_modules(keys, names, want):
    from dmuon.integrations.hooks import layer_modules

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.experts = nn.ParameterList([nn.Parameter(torch.zeros(2, 2, 2))])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class Group(nn.Module):  # no forward: the model calls its members
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Holder(), Holder()

    model = nn.Sequential()
    model.blocks = nn.ModuleList([Holder(), Holder()])
    model.stages = nn.ModuleList([nn.ModuleList([Holder(), Holder()])])
    model.groups = nn.ModuleList([Group()])
    model.scale = nn.Parameter(torch.ones(()))
    model.attn = nn.MultiheadAttention(4, 2)

    class Attention(nn.MultiheadAttention):
        pass

    model.mine = Attention(4, 2)
    assert layer_modules(model, keys, names) == want


def run_submodule_state_dicts(rank, world):
    """Right after a step, the state dict of each block (ZeRO-2-like) and of each linear
    layer holding a dedicated weight (ZeRO-3-like), against the weights after
    ``ded.wait()``."""
    from dmuon.integrations import ddp

    model = Staged()
    ded = ddp.dedicate(model, layer_pack_mb=0)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    train_step(model, opt, 0, rank, world)
    publication = ded.exchange.publication
    pending = publication.pending_publications()
    model.stages[1].state_dict()  # a container holding no weight itself: its block waits
    after = publication.pending_publications()
    saved = {
        f"{s}.{b}.{k}": v.clone()
        for s, stage in enumerate(model.stages)
        for b, block in enumerate(stage)
        for k, v in block.state_dict().items()
    }
    ded.wait()
    current = {
        n: torch.equal(saved[n.removeprefix("stages.")], p.detach())
        for n, p in model.named_parameters()
    }

    model = Staged()
    blocks = {".".join(n.split(".")[:3]) for n, _ in model.named_parameters()}
    ded = ddp.dedicate(
        model,
        reshard_after_forward=True,
        layer_of=lambda name: next(b for b in blocks if name.startswith(b + ".")),
    )
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    train_step(model, opt, 0, rank, world)
    refused = {}
    for name in ded.names:
        try:
            model.get_submodule(name.rpartition(".")[0]).state_dict()
            refused[name] = None
        except RuntimeError as err:
            refused[name] = str(err)
    return pending, after, current, refused, sorted(ded.owned)


def test_a_submodules_state_dict_holds_the_owners_weights_or_is_refused():
    """ZeRO-2-like: a block's ``state_dict()`` right after ``opt.step()`` waits for the
    broadcasts in flight (before, only the model's did, and a block's held last step's
    weights on the ranks that do not own them). ZeRO-3-like: the state dict of a module
    holding a weight this rank does not own, freed, is refused, naming it (before: NaN)."""
    for rank, (pending, after, current, refused, owned) in enumerate(
        run_on_ranks(run_submodule_state_dicts, WORLD, timeout=120)
    ):
        assert (pending, after) == (["stages.0", "stages.1"], []), (rank, pending, after)
        assert all(current.values()), f"rank {rank}: one step old: {current}"
        assert 0 < len(owned) < len(refused), (rank, owned)
        for name, err in refused.items():
            if name in owned:
                assert err is None, (rank, name, err)
            else:
                assert err is not None and repr(name) in err, (rank, name, err)


def test_zero3_like_takes_one_module_per_layer_and_one_layer_per_module():
    """``check_one_module``: a layer waited for at two modules is refused (the first's exit
    would free what the second reads), and so is a module waiting for two layers (its
    backward would free one for the other): an attention module with its ``out_proj``
    outside a numbered block."""
    from dmuon.integrations.hooks import check_one_module

    check_one_module({"blocks.0": ["blocks.0"], "blocks.1": ["blocks.1"]})
    with pytest.raises(ValueError, match=r"layer 'stages.0' names a module"):
        check_one_module({"stages.0": ["stages.0.0", "stages.0.1"]})
    with pytest.raises(ValueError, match=r"module 'pool' is where layers \['pool', 'pool.out"):
        check_one_module({"pool": ["pool"], "pool.out_proj": ["pool"]})


def test_zero3_like_refuses_an_attention_outside_a_block_at_dedicate():
    from dmuon.integrations import ddp

    with pytest.raises(ValueError, match=r"module 'pool' is where layers"):
        ddp.dedicate(Attending(), reshard_after_forward=True)


class TiedHead(nn.Module):
    """An embedding tied with the output head (GPT-2's layout), blocks between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def test_zero3_like_refuses_a_weight_tied_across_layers_and_takes_one_module_reused():
    """``check_untied``: ZeRO-3-like frees a layer's weights after its module's forward, so
    a weight two layers' modules hold would be read freed by the later one (an embedding
    tied with the head under ``scalars="owner"``; a hidden matrix shared by two blocks):
    refused at ``dedicate``, naming both names. A block listed twice (one module object)
    and a weight tied within one layer are taken."""
    from dmuon.integrations import ddp
    from dmuon.integrations.hooks import check_untied

    with pytest.raises(
        ValueError, match=r"'embed.weight' is also 'head.weight'.*\['embed', 'head'\]"
    ):
        ddp.dedicate(TiedHead(), scalars="owner", reshard_after_forward=True)
    shared = TiedHead()
    shared.blocks[2].weight = shared.blocks[0].weight
    with pytest.raises(ValueError, match=r"'blocks.0.weight' is also 'blocks.2.weight'"):
        ddp.dedicate(shared, reshard_after_forward=True)
    reused = TiedHead()
    reused.blocks[2] = reused.blocks[0]  # one module object, called twice
    check_untied(reused, [b.weight for b in reused.blocks], layer_key)
    within = nn.ModuleDict({"block": nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})})
    within.block.b.weight = within.block.a.weight
    check_untied(within, list(within.parameters()), lambda name: "block")  # one layer
