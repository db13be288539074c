"""DMuon's torchtitan container on torchtitan's expert-parallel layout (MoE, EP under FSDP2).

torchtitan 0.3.0 lays out a MoE model with ``expert_parallel_degree`` ``ep`` > 1 in two
steps (``torchtitan.models.deepseek_v3.parallelize_deepseekv3``):

1. ``model.parallelize(parallel_dims)``: each routed-expert stack ``(E, m, n)``
   (``moe.routed_experts.inner_experts.w1_EFD`` …) is ``distribute_tensor``'d on the
   sparse mesh ``("efsdp", "ep")`` with ``(Replicate(), Shard(0))``
   (``moe_sharding.expert_param_placement_sparse``): whole experts split over ``ep``;
2. ``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``: FSDP2 on the dense
   ``fsdp`` mesh for every other parameter, and on ``efsdp`` for the experts, on
   dim 0 — or on dim 1 (each expert's rows) when ``efsdp × ep > num_experts``.

torchtitan's ``ParallelDims.build_mesh`` builds its meshes for ``cuda`` and its models'
attention (flex) has no CPU backward, so here the meshes are made on CPU in torchtitan's
order (world → ``(efsdp, ep)``, ``ep`` innermost; ``fsdp`` over the whole world), step 1
is the same public call (``distribute_tensor`` with those placements), and step 2 is
torchtitan's own ``apply_fsdp_to_decoder``. The model has torchtitan's DeepSeek-V3
parameter names and module structure (a dense first layer, then a MoE layer with router,
routed experts and shared experts); its expert-parallel dispatch, in fp32, gives every
``ep`` rank every token of the ``ep`` group (all-to-alls within the group) and each rank
applies its experts to the tokens routed to them — torchtitan's
``AllToAllTokenDispatcher`` sends only those tokens; each expert's gradient is the same
sum over its tokens either way.

Checked, on 4 gloo ranks (``dp_shard`` 4):

* ``ep`` 2 (``efsdp`` 2) and ``ep`` 4 (``efsdp`` 1): the expert stacks come out
  ``(_StridedShard(0), Shard(0))`` on ``("efsdp", "ep")`` — each rank holds whole
  experts — and the container in ``sharded`` mode (owners for the dense matrices,
  the experts stepped where they are), clipping with its ``clip_grad_norm_``, equals
  one process trained on the same global batches (Muon, NorMuon and Dion3 at ``ep``
  2, Muon at ``ep`` 4); so do ``ep`` 1 (no expert parallelism: FSDP2's
  ``Shard(0)`` of the stacks over ``fsdp``) and ``ep`` 2 laid out as torchtitan's
  default ``spmd_backend="spmd_types"`` gives the experts to FSDP2 (DTensors on the
  whole ``("efsdp", "ep")`` mesh, FSDP2's ``DataParallelMeshDims(shard="efsdp")``: the
  same placements) and ``ep`` 2 under HSDP (``dp_replicate`` 2 × ``dp_shard`` 2:
  ``Replicate()`` over ``dp_replicate`` besides);
* a DCP round trip through the container, as torchtitan's checkpointer makes it:
  saved at ``ep`` 2 after two steps, loaded into a fresh model and container at ``ep``
  2 and at ``ep`` 4 (the experts' state resharded), the third step equals one
  process's;
* 2 experts on 4 ranks (``efsdp × ep`` = 4 > 2): torchtitan shards each expert's rows
  over ``efsdp`` (``Shard(1)``; over ``fsdp`` at ``ep`` 1), which DMuon does not
  gather; the container refuses it on every rank, naming the parameter, its placements
  and what would work, and what it offers (the experts to DMuon's AdamW) equals one
  process; experts split over ``tp`` (torchtitan's ``ep`` 1 with ``tp`` > 1) are
  refused too.

gloo has no ``PREMUL_SUM``, the reduction FSDP2 uses for torchtitan's gradient
division factor of 1; the test forces plain sums (see :func:`parallelize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder  # here: the ranks fork with it

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations.torchtitan import dmuon_optimizer

D, F_EXPERT, F_DENSE, VOCAB, SEQ, BATCH, TOP_K, CLIP = 16, 12, 24, 32, 6, 4, 2, 0.5
OPT = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, ns_compute_dtype=torch.float32)
RULES = ("muon", "normuon", "dion3")
# fp32 throughout; the runs differ only in the order of the gradients' sums (FSDP2's
# reduce-scatters, the experts' dispatch): 3.6e-7 at most after two steps (entries O(1)).
# Experts stepped with the gradient of their ep rank's tokens only are off by 2.7e-2, a
# resumed run without the optimizer's state by 1.4e-2 (both measured).
TOLERANCE = 2e-6


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts`` parameters (``w1_EFD``, ``w2_EDF``, ``w3_EFD``)."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1_EFD = nn.Parameter(torch.randn(num_experts, F_EXPERT, D) / D**0.5)
        self.w2_EDF = nn.Parameter(torch.randn(num_experts, D, F_EXPERT) / F_EXPERT**0.5)
        self.w3_EFD = nn.Parameter(torch.randn(num_experts, F_EXPERT, D) / D**0.5)

    def local(self) -> tuple[torch.Tensor, ...]:
        """This rank's experts (a DTensor's local shard, as torchtitan's forward takes)."""
        ws = (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        return tuple(w.to_local() if hasattr(w, "to_local") else w for w in ws)


class RoutedExperts(nn.Module):
    """torchtitan's ``RoutedExperts``: the experts and the token dispatch over ``ep``."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.inner_experts = GroupedExperts(num_experts)
        self.ep_group = None  # the ep group (torchtitan: ``token_dispatcher.wire_meshes``)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``x`` (T, D) tokens, ``ids``/``scores`` (T, K) routing; returns (T, D)."""
        if self.ep_group is None:
            return _experts(self.inner_experts.local(), 0, x, ids, scores)
        group = self.ep_group
        ep = torch.distributed.get_world_size(group)
        first = torch.distributed.get_rank(group) * (self.inner_experts.num_experts // ep)
        # every token of the ep group reaches the rank holding its experts and the outputs
        # return to the tokens' ranks, summed (torchtitan's dispatch/combine, here with
        # every token sent to every ep rank: those routed elsewhere contribute nothing)
        xs, ss = (_Exchange.apply(t.expand(ep, *t.shape), group).flatten(0, 1) for t in (x, scores))
        ids_all = torch.empty((ep, *ids.shape), dtype=ids.dtype)
        torch.distributed.all_to_all_single(ids_all, ids.expand(ep, *ids.shape).contiguous(),
                                            group=group)  # fmt: skip
        out = _experts(self.inner_experts.local(), first, xs, ids_all.flatten(0, 1), ss)
        return _Exchange.apply(out.view(ep, *x.shape), group).sum(0)


class _Exchange(torch.autograd.Function):
    """``out[j]`` = rank ``j``'s ``t[me]`` in the group (an all-to-all of equal blocks);
    its gradient is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty(t.shape, dtype=t.dtype)
        torch.distributed.all_to_all_single(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty(grad.shape, dtype=grad.dtype)
        torch.distributed.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _experts(ws, first: int, x, ids, scores) -> torch.Tensor:
    """The local experts ``first …`` applied to the tokens routed to them, weighted."""
    w1, w2, w3 = ws
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = (ids == first + e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = F.silu(x[token] @ w1[e].T) * (x[token] @ w3[e].T)
        out = out.index_add(0, token, (h @ w2[e].T) * scores[token, slot, None])
    return out


class FeedForward(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, hidden, bias=False)
        self.w2 = nn.Linear(hidden, D, bias=False)
        self.w3 = nn.Linear(D, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """torchtitan's ``MoE``: ``router.gate``, ``routed_experts``, ``shared_experts``."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.router = nn.Module()
        self.router.gate = nn.Linear(D, num_experts, bias=False)
        self.routed_experts = RoutedExperts(num_experts)
        self.shared_experts = FeedForward(F_EXPERT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        probs = self.router.gate(tokens).softmax(-1)
        scores, ids = probs.topk(TOP_K, dim=-1)
        routed = self.routed_experts(tokens, ids, scores)
        return (routed + self.shared_experts(tokens)).view(b, s, d)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(D, D, bias=False)
        self.wkv = nn.Linear(D, 2 * D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq(x)
        k, v = self.wkv(x).split(D, dim=-1)
        heads = [t.unflatten(-1, (2, D // 2)).transpose(1, 2) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.wo(o.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A torchtitan ``Decoder`` layer: dense (``feed_forward``) or MoE (``moe``)."""

    def __init__(self, num_experts: int | None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(D)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(D)
        self.moe_enabled = num_experts is not None
        if num_experts is None:
            self.feed_forward = FeedForward(F_DENSE)
        else:
            self.moe = MoE(num_experts)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class TitanMoE(nn.Module):
    """Laid out like torchtitan's DeepSeek-V3 ``Decoder`` (what ``apply_fsdp_to_decoder``
    reads: ``tok_embeddings``, ``layers``, ``norm``, ``lm_head``, ``enable_weight_tying``,
    each layer's ``moe_enabled`` and ``moe.routed_experts.inner_experts``)."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.enable_weight_tying = False
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            self.tok_embeddings = nn.Embedding(VOCAB, D)
            self.layers = nn.ModuleDict({"0": Block(None), "1": Block(num_experts)})
            self.norm = nn.RMSNorm(D)
            self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + t)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, container, steps, rows=slice(None)) -> list[float]:
    """torchtitan's loss: the sum over this rank's tokens divided by the global count
    (its FSDP2 gradients are sums: ``disable_fsdp_gradient_division``); the gradients
    clipped by the container (:func:`dmuon.optim.clip_grad_norm_`). Returns the norms."""
    norms = []
    for t in steps:
        tokens, labels = batch(t)
        logits = model(tokens[rows])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), reduction="sum")
        (loss / labels.numel()).backward()
        norms.append(float(container.clip_grad_norm_(CLIP)))
        container.step()
        container.zero_grad()
    return norms


def reference(rule: str, num_experts: int, steps: int) -> tuple[dict[str, torch.Tensor], list]:
    model = TitanMoE(num_experts)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    container = dmuon_optimizer(mode="single", rule=rule, **OPT).build(model_parts=[model])
    norms = train(model, container, range(steps))
    assert min(norms) > CLIP, f"clipping never engaged: {norms}"
    moved = min(
        (p.detach() - initial[n]).abs().max().item()
        for n, p in model.named_parameters()
        if "inner_experts" in n
    )
    assert moved > 1e-3, "an expert stack barely moved; the test would prove nothing"
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def parallelize(model: TitanMoE, ep: int, form: str = "partial") -> TitanMoE:
    """torchtitan's EP layout on CPU meshes (module docstring): experts on ``ep``, then
    torchtitan's ``apply_fsdp_to_decoder`` (``ep`` 1: no expert parallelism, FSDP2 over
    ``fsdp`` for every parameter).

    ``form``: ``"partial"``, torchtitan's ``spmd_backend="partial_dtensor"`` (the
    experts ``Shard(0)`` on the ``ep`` mesh alone, FSDP2 given the ``efsdp`` mesh);
    ``"spmd"``, the experts as its default ``"spmd_types"`` (and ``"full_dtensor"``)
    hands them to FSDP2 — DTensors on the whole sparse mesh, ``(Replicate(),
    Shard(0))`` on ``("efsdp", "ep")``, sharded over the ``efsdp`` dimension named by
    ``DataParallelMeshDims``; ``"hsdp"``, ``"partial"`` with ``dp_replicate`` 2
    (torchtitan's HSDP: the meshes ``("dp_replicate", "fsdp")`` and
    ``("dp_replicate", "efsdp", "ep")``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = torch.distributed.get_world_size()
    if form == "hsdp":
        dp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "fsdp"))
        sparse = init_device_mesh(
            "cpu", (2, world // 2 // ep, ep), mesh_dim_names=("dp_replicate", "efsdp", "ep")
        )
        edp_mesh = sparse["dp_replicate", "efsdp"]
    else:
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        sparse = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        edp_mesh = sparse if form == "spmd" else sparse["efsdp"]
    spmd = form == "spmd"
    routed = model.layers["1"].moe.routed_experts
    experts = routed.inner_experts
    if ep > 1:
        mesh, placements = (sparse, [Replicate(), Shard(0)]) if spmd else (sparse["ep"], [Shard(0)])
        for name, param in list(experts.named_parameters(recurse=False)):
            placed = distribute_tensor(param.detach(), mesh, placements)
            experts.register_parameter(name, nn.Parameter(placed))
        routed.ep_group = sparse.get_group("ep")
    apply_fsdp_to_decoder(
        model,
        dp_mesh,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        pp_enabled=False,
        ep_degree=ep,
        edp_mesh=None if ep == 1 else edp_mesh,
        edp_mesh_dims=DataParallelMeshDims(shard="efsdp") if spmd else None,
    )
    # torchtitan turns FSDP2's gradient division off (a factor of 1: the loss is divided
    # by the global token count), which FSDP2 does with a PREMUL_SUM reduction gloo does
    # not have; a plain sum is the same (the call torchtitan's enable_fsdp_symm_mem makes)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def run_ep(rank, world, runs, steps):
    out = []
    for rule, ep, form in runs:
        model = parallelize(TitanMoE(4), ep, form)
        container = dmuon_optimizer(rule=rule, **OPT).build(model_parts=[model])
        stack = model.layers["1"].moe.routed_experts.inner_experts.w1_EFD
        layout = (tuple(map(repr, stack.placements)), stack.device_mesh.mesh_dim_names)
        owner = container.dmuon.engine.owner_of(stack)
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        norms = train(model, container, range(steps), rows)
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out.append((container.dmuon.engine.mode, layout, owner, norms, full))
    return out


def check(results, want, what) -> None:
    for rank, (*_, got) in enumerate(results):
        for name, w in want.items():
            diff = (got[name] - w).abs().max().item()
            assert diff <= TOLERANCE, f"{what}, rank {rank}: {name} off by {diff:.2e}"


# ep 2: efsdp 2 (each rank 1 of 4 experts, FSDP2 over pairs), also as the spmd_types
# backend lays it out, and under HSDP (efsdp 1); ep 4: efsdp 1; ep 1: no expert
# parallelism, FSDP2's Shard(0) of the stacks over fsdp (1 expert per rank)
RUNS = [(rule, 2, "partial") for rule in RULES] + [("muon", 2, "spmd"), ("muon", 2, "hsdp")]
RUNS += [("muon", 4, "partial"), ("muon", 1, "partial")]
PLACEMENTS = {
    2: (("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), ("efsdp", "ep")),
    4: (("_StridedShard(dim=0, sf=4)", "Shard(dim=0)"), ("efsdp", "ep")),
    1: (("Shard(dim=0)",), ("fsdp",)),
    "hsdp": (
        ("Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
        ("dp_replicate", "efsdp", "ep"),
    ),
}


def test_container_steps_torchtitans_expert_parallel_layout_like_one_process():
    results = run_on_ranks(run_ep, 4, args=(RUNS, 2), timeout=300)
    for i, (rule, ep, form) in enumerate(RUNS):
        want, want_norms = reference(rule, 4, 2)
        runs = [r[i] for r in results]
        for rank, (mode, layout, owner, norms, _) in enumerate(runs):
            assert mode == "sharded", (rank, mode)
            want_layout = PLACEMENTS["hsdp" if form == "hsdp" else ep]
            assert layout == want_layout, (rank, ep, form, layout)  # whole experts per rank
            assert owner is None, f"rank {rank}: experts planned to owner {owner}"
            for a, b in zip(norms, want_norms, strict=True):
                assert abs(a - b) <= 1e-5 * b, f"{rule}, ep {ep}, rank {rank}: norm {a} vs {b}"
        check(runs, want, f"{rule}, ep {ep}, {form}")


def run_save_load(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    model = parallelize(TitanMoE(4), 2)
    container = dmuon_optimizer(rule="normuon", **OPT).build(model_parts=[model])
    train(model, container, range(2), rows)
    dcp.save({"model": get_model_state_dict(model), "optimizer": container}, checkpoint_id=path)
    torch.distributed.barrier()
    out = {}
    for load_ep in (2, 4):  # the same layout; experts resharded (2 per rank pair → 1 per rank)
        fresh = parallelize(TitanMoE(4), load_ep)  # initial weights: all from the checkpoint
        resumed = dmuon_optimizer(rule="normuon", **OPT).build(model_parts=[fresh])
        state = {"model": get_model_state_dict(fresh), "optimizer": resumed}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(fresh, state["model"])
        train(fresh, resumed, [2], rows)
        out[load_ep] = {n: p.detach().full_tensor() for n, p in fresh.named_parameters()}
    return out


def test_dcp_round_trip_with_expert_parallelism_equals_continuing(tmp_path):
    want, _ = reference("normuon", 4, 3)
    results = run_on_ranks(run_save_load, 4, args=(str(tmp_path / "ckpt"),), timeout=180)
    for load_ep in (2, 4):
        check([(r[load_ep],) for r in results], want, f"saved at ep 2, resumed at ep {load_ep}")


def experts_to_adamw():
    """torchtitan patterns: the expert stacks to DMuon's AdamW, the rest DMuon's grouping."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from dmuon.integrations.torchtitan import DMuonOptimizersContainer

    return DMuonOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r"(inner_experts|embeddings|lm_head|norm)",
                optimizer_name="DMuon",
                optimizer_kwargs={"rule": "scalar"},
            ),
            ParamGroupConfig(pattern=r".*", optimizer_name="DMuon"),
        ],
        dmuon=OPT,
    )


def refusal(model) -> str | None:
    try:
        dmuon_optimizer().build(model_parts=[model])
    except ValueError as err:
        return str(err)
    return None


def run_rows_split(rank, world):
    """2 experts on efsdp 2 × ep 2: torchtitan shards each expert's rows over efsdp (and
    over fsdp without expert parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    no_ep = parallelize(TitanMoE(2), 1)
    no_ep_stack = no_ep.layers["1"].moe.routed_experts.inner_experts.w2_EDF
    no_ep_refusal = (tuple(map(repr, no_ep_stack.placements)), refusal(no_ep))
    # ep 1 with tp 2: torchtitan's expert_param_placement_dense splits w1/w3 on dim 1 and
    # w2 on dim 2 over tp (refused before FSDP2 matters: the container checks first)
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    tp_model = TitanMoE(4)
    tp_experts = tp_model.layers["1"].moe.routed_experts.inner_experts
    for name, dim in (("w1_EFD", 1), ("w2_EDF", 2), ("w3_EFD", 1)):
        placed = distribute_tensor(getattr(tp_experts, name).detach(), tp_mesh, [Shard(dim)])
        tp_experts.register_parameter(name, nn.Parameter(placed))
    tp_refusal = refusal(tp_model)
    model = parallelize(TitanMoE(2), 2)
    stack = model.layers["1"].moe.routed_experts.inner_experts.w1_EFD
    placements = tuple(map(repr, stack.placements))
    message = refusal(model)
    # what the error offers: the experts to DMuon's AdamW, the dense matrices sharded
    container = experts_to_adamw().build(model_parts=[model])
    train(model, container, range(2), slice(rank * BATCH // world, (rank + 1) * BATCH // world))
    full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return (no_ep_refusal, tp_refusal), placements, message, container.dmuon.engine.mode, full


def test_expert_rows_split_over_efsdp_is_refused_on_every_rank():
    results = run_on_ranks(run_rows_split, 4, timeout=120)
    for rank, (((no_ep, no_ep_message), tp), placements, message, _, _) in enumerate(results):
        assert no_ep == ("Shard(dim=1)",), (rank, no_ep)
        assert no_ep_message is not None, f"rank {rank}: ep 1, built without error"
        assert "inner_experts.w1_EFD" in no_ep_message, no_ep_message
        assert "num_experts (2)" in no_ep_message, no_ep_message
        assert tp is not None, f"rank {rank}: experts split over tp, built without error"
        assert "inner_experts.w1_EFD" in tp and "['tp']" in tp, tp
        assert "expert_parallel_degree > 1" in tp, tp
        assert placements == ("Shard(dim=1)", "Shard(dim=0)"), (rank, placements)
        assert message is not None, f"rank {rank}: built without error"
        assert "layers.1.moe.routed_experts.inner_experts.w1_EFD" in message, message
        assert "(Shard(dim=1), Shard(dim=0))" in message and "num_experts (2)" in message
        assert "'rule': 'scalar'" in message, message
    model = TitanMoE(2)
    config = experts_to_adamw()
    config.mode = "single"
    train(model, config.build(model_parts=[model]), range(2))
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert all(r[3] == "sharded" for r in results), results
    check([r[4:] for r in results], want, "experts to AdamW")
