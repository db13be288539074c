"""Hugging Face's own expert parallelism: Mixtral with ``DistributedConfig(fsdp_size, ep_size)``.

transformers (5.x) stores a MoE block's experts as stacks — ``gate_up_proj``
``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)`` — which ``param_groups`` puts in a
matrix group with ``flatten=False``. Loaded with ``ep_size`` under FSDP2, the dense
matrices are FSDP2 rows (``Shard(0)`` on ``fsdp``) and each expert stack is
``(_StridedShard(0), Shard(0))`` on ``("efsdp", "ep")``: split along the expert
dimension only, so every rank holds whole experts with whole gradients (HF's
all-to-all dispatch brings each expert every token routed to it, FSDP2 averages over
``efsdp``). ``sharded`` mode — the mode DMuon picks for DTensor matrices — moves the
dense matrices to owners and steps the experts where they are
(:attr:`~dmuon.optim.engine.placements.MatrixPlacement.whole_experts`); on 2 ranks
(an ``efsdp`` of one rank) and on 4 (``efsdp`` 2 × ``ep`` 2), each run equals one
process trained on the same global batches. The model is built from a config and saved
locally: no download.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dmuon.comm.testing import run_on_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers: pip install 'dmuon-optim[hf]'",
)

OPT = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, ns_compute_dtype=torch.float32)
STEPS = 2
BATCH, SEQ, VOCAB = 4, 12, 64  # global sequences per step, split evenly over the ranks
# fp32 throughout; the runs differ in the order of the gradients' sums (FSDP2's
# reduce-scatter, the experts' dispatch). Measured after 2 steps: 3e-7 at most (entries
# O(1)); an expert stepped with a partial or doubled gradient is off by ~lr = 2e-2.
TOLERANCE = 2e-6


def save_tiny_mixtral(path: str) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MixtralForCausalLM(config).save_pretrained(path)


def tokens(t: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(t))


def train(model, opt, rows: slice) -> None:
    for t in range(STEPS):
        ids = tokens(t)[rows]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def run_expert_parallel(rank, world, path, rule, fsdp, ep):
    from transformers import MixtralForCausalLM
    from transformers.distributed import DistributedConfig

    from dmuon.optim import DMuon, param_groups
    from dmuon.optim.engine.placements import placement_of_param

    model = MixtralForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=fsdp, ep_size=ep)
    )
    opt = DMuon(param_groups(model), rule=rule, **OPT)
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    info = opt.engine.info(stack)
    layout = (placement_of_param(info).summary(), opt.engine.owner_of(stack))
    rows = BATCH // world
    train(model, opt, slice(rank * rows, (rank + 1) * rows))
    state = tuple(opt.state[stack]["momentum_buffer"].shape)
    full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return opt.mode, layout, tuple(stack.to_local().shape), state, full


def reference(path: str, rule: str) -> dict[str, torch.Tensor]:
    from transformers import MixtralForCausalLM

    from dmuon.optim import DMuon, param_groups

    model = MixtralForCausalLM.from_pretrained(path)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, DMuon(param_groups(model), rule=rule, **OPT), slice(None))
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-3, "the reference barely moved; the test would prove nothing"
    return {n: p.detach() for n, p in model.named_parameters()}


# HF's layout of an expert stack in both runs (at world 2 its efsdp dimension has one rank)
STACK = "(_StridedShard(dim=0, sf=2), Shard(dim=0)) on mesh dims ('efsdp', 'ep')"


@pytest.mark.parametrize(
    ("world", "fsdp", "ep", "rules"),
    [(2, 2, 2, ("muon", "normuon")), (4, 4, 2, ("muon",))],
    ids=["fsdp2-ep2", "fsdp4-ep2"],
)
def test_hf_expert_parallel_mixtral_in_sharded_mode_equals_one_process(
    tmp_path, world, fsdp, ep, rules
):
    path = str(tmp_path / "mixtral")
    save_tiny_mixtral(path)
    for rule in rules:
        want = reference(path, rule)
        results = run_on_ranks(run_expert_parallel, world, args=(path, rule, fsdp, ep), timeout=300)
        for rank, (mode, (layout, owner), local, state, got) in enumerate(results):
            assert mode == "sharded" and layout == STACK, (rank, mode, layout)
            # stepped where they are: no owner, state for this rank's experts only
            assert owner is None, f"rank {rank}: the experts were planned to owner {owner}"
            assert local == (4 // world, 48, 16) and state == local, (rank, local, state)
            for name, w in want.items():
                diff = (got[name] - w).abs().max().item()
                assert diff <= TOLERANCE, f"{rule}, rank {rank}: {name} off by {diff:.2e}"
