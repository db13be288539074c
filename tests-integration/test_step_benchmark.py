"""``benchmarks/step.py --world N`` runs every setup at a tiny size and writes its results.

The benchmark's figures are reported, never asserted (tests do not time); what is
checked is that every setup — the opt-in ones too — builds, steps on 2 gloo ranks,
and lands in the JSON with its phases, and that the owner-mode setups split the
matrices between the ranks (the plan the step ratios rest on).
"""

from __future__ import annotations

import json

import torch

from benchmarks import step, step_world
from benchmarks.common.memory import held_bytes
from benchmarks.common.model import GPT


def test_every_setup_steps_on_two_ranks_and_is_written(tmp_path):
    setups = [s for s in step_world.SETUPS if s != "torch_muon_ddp"]  # bf16 NS: minutes on CPU
    argv = ["--world", "2", "--quick", "--steps", "2", "--out", str(tmp_path), "--setups", *setups]
    assert step.main(argv) == 0
    result = json.loads((tmp_path / "step-world2-cpu-quick.json").read_text())
    assert (tmp_path / "step-world2-cpu-quick.png").stat().st_size > 10_000
    assert sorted(result["rows"]) == sorted(setups)
    # the ranks' threads, not the launcher's, and the world they ran in
    meta = result["meta"]
    assert meta["world_size"] == 2
    assert meta["torch_threads"] == meta["threads_per_rank"] == step_world.THREADS_PER_RANK == 1
    for name, row in result["rows"].items():
        assert set(row["seconds"]) == set(step_world.PHASES), name
        assert row["total"] > 0 and len(row["all_totals"]) == 2, name
    for name in ("owner_fsdp", "owner_ddp", "owner_ddp_zero1"):
        per_rank = result["rows"][name]["matrices_per_rank"]
        assert sum(per_rank) == 8 and min(per_rank) > 0, (name, per_rank)
    assert result["rows"]["muon_vanilla"]["matrices_per_rank"] == [8, 8]
    # memory counted from the tensors at the end of the last backward: DDP holds every
    # weight and gradient on both ranks, FSDP2 half of them; AdamW keeps two moments
    params = sum(p.numel() for p in GPT(step_world.QUICK.gpt()).parameters()) * 4
    ddp = result["rows"]["adamw_ddp"]["memory_bytes_per_rank"]
    fsdp = result["rows"]["adamw_fsdp"]["memory_bytes_per_rank"]
    for rank in range(2):
        assert ddp[rank]["weights"] == ddp[rank]["gradients"] == params
        # exp_avg and exp_avg_sq of every parameter, and a scalar step per parameter
        n_params = len(list(GPT(step_world.QUICK.gpt()).parameters()))
        assert ddp[rank]["optimizer_state"] == 2 * params + 4 * n_params
        assert fsdp[rank]["weights"] < 0.6 * params
    assert all(r > 0 for r in result["rows"]["adamw_ddp"]["peak_rss_bytes_per_rank"])


def test_held_bytes_counts_each_storage_once():
    # two parameters that are views into one flat buffer count the buffer once; a
    # buffer the optimizer holds that is neither a weight, a gradient nor state is a
    # buffer
    flat = torch.zeros(10)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(flat[:4].view(2, 2))
    module.b = torch.nn.Parameter(flat[4:].view(2, 3))
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    opt.staging = torch.zeros(7)
    held = held_bytes(module, opt)
    assert held["weights"] == 10 * 4
    assert held["gradients"] == 10 * 4  # two storages, 4 + 6 elements
    assert held["optimizer_state"] == 10 * 4  # the momentum buffers
    assert held["buffers"] == 7 * 4
    assert held["total"] == 37 * 4
