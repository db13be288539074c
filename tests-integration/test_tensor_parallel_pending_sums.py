"""Tensor-parallel models whose matrices are replicated whole, or whose gradients arrive as
pending sums (``Partial``), stepped like one process in ``single``, ``replicated`` and
``owner`` mode.

Two layouts torch's DTensor produces in real models, which no earlier test covered:

* a matrix kept whole inside a tensor-parallel model (``Replicate()`` on every mesh
  dimension: torchtitan's ``NoParallel`` router gate). Its gradient is ``Replicate()``
  when the layer reads a replicated activation (``head`` below) and a pending sum over
  ``tp`` when it reads a token-sharded one (``mix``): each ``tp`` rank's local part is the
  gradient of its tokens only. Every mode must carry the sum out before the rule and
  keep the parameter a DTensor with its placements;
* a rowwise (``Shard(1)``) weight that reads a token-sharded activation (``tok``):
  DTensor all-gathers the weight in the forward and hands back a ``Partial()`` gradient,
  whose local part is a whole-matrix partial sum, not the shard. Owner mode reduced that
  local part over ``dp`` into the shard's bucket (a shape error in the backward hook);
  it must be laid out as the shard (a reduce-scatter over ``tp``) first.

The reference is one process on the same global batches, with clipping engaged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensor_parallel_cases import OPT, SPLIT_TOLERANCE, STEPS, error, mode_mesh
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, clip_grad_norm_, param_groups

TOKENS = 8  # per global batch: 2 dp rows × 2 tp ranks × 2 tokens
CLIP = 0.1  # below every step's gradient norm (≥ 0.15 in both models): every step is clipped


class PendingNet(nn.Module):
    """``tok`` (8 → 8), ``mix`` (8 → 8), ``fc1`` (8 → 12), ``fc2`` (12 → 8), ``head``
    (8 → 6). Over ``tp`` (:func:`parallelize`): ``tok`` rowwise on token-sharded input
    (a ``Partial`` gradient of a split matrix), ``mix`` whole on token-sharded input (a
    ``Partial`` gradient of a replicated matrix), ``fc1`` colwise (gathering the tokens),
    ``fc2`` rowwise back to a replicated activation, ``head`` whole on it (a
    ``Replicate()`` gradient). ``whole=False`` leaves ``mix`` and ``head`` out."""

    def __init__(self, whole: bool = True) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            self.tok = nn.Linear(8, 8)
            self.mix = nn.Linear(8, 8) if whole else None
            self.fc1 = nn.Linear(8, 12)
            self.fc2 = nn.Linear(12, 8)
            self.head = nn.Linear(8, 6) if whole else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.tok(x))
        if self.mix is not None:
            h = torch.tanh(self.mix(h))
        h = F.relu(self.fc2(F.relu(self.fc1(h))))
        return self.head(h) if self.head is not None else h


def batch(t: int, whole: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + t)
    return torch.randn(TOKENS, 8, generator=g), torch.randn(TOKENS, 6 if whole else 8, generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def parallelize(model: PendingNet, tp) -> PendingNet:
    """``model`` over the 1-D ``tp`` mesh, with torch's public APIs only (``distribute_module``
    is how torchtitan's ``NoParallel`` keeps a layer whole)."""
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def on(placement):
        def inputs(mod, args, mesh):
            return (DTensor.from_local(args[0], mesh, [placement], run_check=False),)

        return inputs

    def local(mod, out, mesh):
        return out.to_local()

    def rowwise_weight(name, mod, mesh):
        for key, p in list(mod.named_parameters(recurse=False)):
            pl = [Shard(1)] if key == "weight" else [Replicate()]
            mod.register_parameter(key, nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))

    tokens = Shard(0)  # each tp rank its tokens
    distribute_module(model.tok, tp, rowwise_weight, on(tokens), local)
    if model.mix is not None:
        distribute_module(model.mix, tp, None, on(tokens), local)  # Replicate() parameters
        distribute_module(model.head, tp, None, on(Replicate()), local)
    parallelize_module(
        model,
        tp,
        {
            "fc1": ColwiseParallel(input_layouts=tokens),
            "fc2": RowwiseParallel(output_layouts=Replicate()),
        },
    )
    return model


def reference(whole: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = PendingNet(whole)
    opt = DMuon(param_groups(model), **OPT)
    norms = []
    for t in range(STEPS):
        x, y = batch(t, whole)
        loss_of(model(x), y).backward()
        norms.append(float(clip_grad_norm_(opt, CLIP)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def run_pending(rank, world, mode, whole):
    """``single``: tp 2, each rank half the tokens of every batch. ``replicated`` and
    ``owner``: dp 2 × tp 2, each dp row half of every batch (averaged over dp: by hand as
    DDP would, or by the dedication), each tp rank half of its row's tokens."""
    import torch.distributed as dist

    from dmuon.integrations import ddp
    from dmuon.optim.matrix_split import local_tensor

    mesh, tp, rows, row = mode_mesh(mode, world)
    model = parallelize(PendingNet(whole), tp)
    ded = ddp.dedicate(model, mesh) if mode == "owner" else None
    dp = mesh["dp"].get_group() if mode == "replicated" else None
    opt = DMuon(param_groups(model), mode=mode, distributed=ded, process_group=dp, **OPT)
    placements, norms = [], []
    n_tp, me = tp.size(), tp.get_local_rank()
    for t in range(STEPS):
        x, y = batch(t, whole)
        rows_of = slice(TOKENS // rows * row, TOKENS // rows * (row + 1))
        x, y = x[rows_of], y[rows_of]
        mine = x.chunk(n_tp)[me]  # this tp rank's tokens; the output is every token's
        loss_of(model(mine), y).backward()
        placements.append({n: str(p.grad.placements) for n, p in model.named_parameters()})
        if dp is not None:  # DDP's average over dp, local part by local part
            for p in model.parameters():
                dist.all_reduce(local_tensor(p.grad), group=dp)
                local_tensor(p.grad).div_(2)
        norms.append(float(clip_grad_norm_(opt, CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=bool(t % 2))  # zeroed gradients, then none
    if ded is not None:
        ded.wait()
    kept = {n: str(p.placements) for n, p in model.named_parameters()}
    full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return placements, kept, full, norms


CASES = [("single", 2, True), ("replicated", 4, True), ("owner", 4, True), ("owner", 4, False)]


@pytest.mark.parametrize(("mode", "world", "whole"), CASES)
def test_replicated_matrices_and_pending_sums_step_like_one_process(mode, world, whole):
    expected, want_norms = reference(whole)
    initial = {n: p.detach().clone() for n, p in PendingNet(whole).named_parameters()}
    assert min(want_norms) > CLIP, f"clipping never engaged: {want_norms}"
    results = run_on_ranks(run_pending, world, args=(mode, whole), timeout=240)
    for rank, (placements, kept, got, norms) in enumerate(results):
        # what makes the case: the layouts DTensor's backward hands out
        grads = placements[0]
        assert grads["tok.weight"] == "(Partial(sum),)", (rank, grads)  # a split matrix's
        if whole:
            assert grads["mix.weight"] == "(Partial(sum),)", (rank, grads)
            assert grads["head.weight"] == "(Replicate(),)", (rank, grads)
            assert kept["mix.weight"] == kept["head.weight"] == "(Replicate(),)", kept
        assert kept["tok.weight"] == "(Shard(dim=1),)", kept
        for a, b in zip(norms, want_norms, strict=True):
            assert abs(a - b) <= 1e-5 * b, f"{mode}, rank {rank}: norm {a} vs {b}"
        for name, want in expected.items():
            assert (want - initial[name]).abs().max().item() > 1e-3, name  # the reference moved
            diff = (got[name] - want).abs().max().item()
            assert diff <= SPLIT_TOLERANCE, f"{mode}, rank {rank}: {name} differs by {diff:.2e}"


def run_refused(rank, world, mode):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(PendingNet(), mesh)
    groups = [{"params": [model.mix.weight, model.head.weight]}]  # whole matrices only
    rule = {"rule": "sign_muon"} if mode == "sign" else {}
    return error(lambda: DMuon(groups, mode=mode, **rule))


@pytest.mark.parametrize("mode", ["sharded", "sign"])
def test_sharded_and_sign_mode_refuse_a_replicated_matrix_saying_why_on_every_rank(mode):
    """Sharded mode relies on FSDP2 to average the gradients it steps, and FSDP2 shards
    every parameter it manages: a matrix replicated on every mesh dimension is one it
    does not manage. Sign mode votes on local gradients. Both refuse, naming the
    parameter, its placements and the modes that step it."""
    for rank, msg in enumerate(run_on_ranks(run_refused, 2, args=(mode,), timeout=120)):
        assert msg is not None, f"rank {rank}: mode={mode!r} took a replicated matrix"
        assert "'group0.param0'" in msg and "(Replicate(),) on mesh dims ('tp',)" in msg, msg
        assert "mode='single'" in msg and "mode='replicated'" in msg, msg
        why = "FSDP2 shards every parameter it manages" if mode == "sharded" else "Sign-Muon votes"
        assert why in msg, msg


def run_counted(rank, world, mode, clip=False):
    """One step of :class:`PendingNet` (``clip``: with ``clip_grad_norm_`` before it), the
    pending sums' bytes counted from the backward on in the engine's ``CommStats``: the
    default one, or in owner mode the dedication's own (``dedicate(stats=...)``), the
    default then left untouched."""
    import torch.distributed as dist

    from dmuon.comm import CommStats, default_stats
    from dmuon.integrations import ddp
    from dmuon.optim.engine.relayout import PENDING_SUM_STATS_NAME
    from dmuon.optim.matrix_split import local_tensor

    mesh, tp, rows, row = mode_mesh(mode, world)
    model = parallelize(PendingNet(), tp)
    own = CommStats()
    ded = ddp.dedicate(model, mesh, stats=own) if mode == "owner" else None
    dp = mesh["dp"].get_group() if mode == "replicated" else None
    opt = DMuon(param_groups(model), mode=mode, distributed=ded, process_group=dp, **OPT)
    x, y = batch(0)
    rows_of = slice(TOKENS // rows * row, TOKENS // rows * (row + 1))
    mine = x[rows_of].chunk(tp.size())[tp.get_local_rank()]
    default_stats().reset()  # owner mode lays the rowwise weight out in the backward
    loss_of(model(mine), y[rows_of]).backward()
    if dp is not None:
        for p in model.parameters():
            dist.all_reduce(local_tensor(p.grad), group=dp)
    if clip:
        clip_grad_norm_(opt, CLIP)
    opt.step()
    if ded is not None:
        ded.wait()
        assert PENDING_SUM_STATS_NAME not in default_stats(), default_stats().as_dict()
        return own[PENDING_SUM_STATS_NAME]
    return default_stats()[PENDING_SUM_STATS_NAME]


# fp32, tp 2, per rank: tok.weight's reduce-scatter of 2 padded blocks 8 × 4 (gloo: an
# all-reduce of them), mix.weight's all-reduce of its 8 × 8 local part, tok.bias's and
# mix.bias's of 8 entries each (the scalar step)
TOK, MIX, BIASES = 2 * 8 * 4 * 4, 8 * 8 * 4, 2 * 8 * 4


@pytest.mark.parametrize(("mode", "world"), [("single", 2), ("replicated", 4), ("owner", 4)])
def test_pending_sums_are_counted_as_the_collectives_they_are(mode, world):
    """Every collective that carries out a pending sum over ``tp`` is recorded under
    ``"tensor_parallel_pending_sum"``, with the bytes it hands to torch, counted by hand
    from :class:`PendingNet`'s layouts (:data:`TOK`, :data:`MIX`, :data:`BIASES`): every
    rank all four in ``single`` and ``replicated`` mode; in owner mode ``mix.weight``'s
    only on its owner's tp row (its gradient travels over ``dp`` as a pending sum).
    An all-reduce over 2 ranks sends and receives ``2(t−1)/t = 1`` times its buffer."""
    check_counted(run_on_ranks(run_counted, world, args=(mode,), timeout=240), mode)


@pytest.mark.parametrize(("mode", "world"), [("single", 2), ("replicated", 4), ("owner", 4)])
def test_clipping_carries_each_pending_sum_out_once(mode, world):
    """``clip_grad_norm_`` carries out the pending sums it needs for the norm and leaves
    them in ``p.grad``: the step that follows finds them settled and sums nothing again, so
    a clipped step makes the collectives of an unclipped one, no more (the clip summed a
    scalar's pending sum for its norm only, and the step summed it again: 6 all-reduces
    per rank in ``single`` mode instead of 4). The results stay the one process's
    (:func:`test_replicated_matrices_and_pending_sums_step_like_one_process`, clipped)."""
    check_counted(run_on_ranks(run_counted, world, args=(mode, True), timeout=240), mode)


def check_counted(got, mode):
    """The hand count of :func:`test_pending_sums_are_counted_as_the_collectives_they_are`
    against ``got``, each rank's ``CommStats`` entry."""
    if mode != "owner":
        for rank, s in enumerate(got):
            assert s.collectives == 4, (mode, rank, s)
            assert s.payload_bytes == TOK + MIX + BIASES, (mode, rank, s)
            assert s.bytes_sent == s.bytes_received == TOK + MIX + BIASES, (mode, rank, s)
        return
    rows = [got[0:2], got[2:4]]  # dp rows of the dp 2 × tp 2 mesh (tp innermost)
    owners = [r for r, pair in enumerate(rows) if pair[0].collectives == 4]
    assert len(owners) == 1, got  # one tp row owns mix.weight
    for r, pair in enumerate(rows):
        mix = MIX if r in owners else 0
        for s in pair:
            assert s.collectives == 3 + (mix > 0), (r, s)
            assert s.payload_bytes == s.bytes_sent == TOK + mix + BIASES, (r, s)


def run_clamped(rank, world):
    """Three steps of :class:`PendingNet` over tp 2 (``single``), each clamped by
    ``clip_grad_value_`` and zeroed with ``set_to_none=False``: each step's ``tok.bias``
    gradient layout and pending-sum collectives counted in the default ``CommStats``."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.comm import default_stats
    from dmuon.optim import clip_grad_value_
    from dmuon.optim.engine.relayout import PENDING_SUM_STATS_NAME

    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(PendingNet(), tp)
    opt = DMuon(param_groups(model), mode="single", **OPT)
    out = []
    for t in range(3):
        x, y = batch(t)
        default_stats().reset()
        loss_of(model(x.chunk(world)[rank]), y).backward()
        layout = str(model.tok.bias.grad.placements)
        clip_grad_value_(opt, 0.01)
        opt.step()
        out.append((layout, default_stats()[PENDING_SUM_STATS_NAME].collectives))
        opt.zero_grad(set_to_none=False)
    return out


def test_clip_grad_value_leaves_the_sums_for_zero_grad_to_drop():
    """``clip_grad_value_`` carries a scalar's pending sum out and leaves it in ``p.grad``,
    marked like the step's: ``zero_grad(set_to_none=False)`` drops it, so the next backward
    hands a pending sum again, which DMuon carries out under its deadline (4 counted
    collectives a step: tok.weight's, mix.weight's, the two biases'). Before, the zeroed
    sum stayed, and the next backward added its pending sum to it in DTensor's own
    untimed all-reduce: ``Replicate()`` gradients and 2 counted collectives from step 2 on."""
    for rank, steps in enumerate(run_on_ranks(run_clamped, 2, timeout=120)):
        assert steps == [("(Partial(sum),)", 4)] * 3, (rank, steps)
