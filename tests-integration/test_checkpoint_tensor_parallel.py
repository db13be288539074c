"""Checkpoints of owner-held tensor-parallel state: saved on ``dp 2 × tp 2``, resumed anywhere.

In ``sharded`` mode on FSDP2 over tensor parallelism, and in ``replicated`` and owner
mode (``ddp.dedicate(model, mesh)``) on a ``dp × tp`` mesh, each split matrix's state
lives on its owner's ``tp`` row, each
rank holding its shard's. A DCP checkpoint stores it laid out like the parameter,
so it must resume: on the same mesh, in one process (unsplit, ``single``), and on
``dp 4`` with plain FSDP2 (no tensor parallelism, other owners) — each equal to
continuing the saved run. The full state dict gives the same state in one file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensor_parallel_cases import OPT, SPLIT_TOLERANCE, DeepMLP, deep_batch, tp_deep_mlp

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

# NorMuon: per-row state, split or whole; Dion3: whole state on the owner's tp row
RULES = {"muon": {}, "normuon": {"beta2": 0.9}, "dion3": {}}


def build(layout: str, rule: str):
    """``(model, optimizer, rows)`` on this rank: ``rows`` picks its part of a batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if layout == "fsdp_dp4":  # no tensor parallelism: plain FSDP2 over all 4 ranks
        model = DeepMLP()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        opt = DMuon(param_groups(model), rule=rule, **OPT, **RULES[rule])
        return model, opt, (dist.get_rank(), world), None
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if layout == "fsdp_tp_half":  # fc3 and fc4 whole: FSDP2 shards them over dp alone
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = DeepMLP()
        styles = {
            "fc1": ColwiseParallel(output_layouts=Replicate()),
            "fc2": RowwiseParallel(input_layouts=Replicate()),
        }
        parallelize_module(model, mesh["tp"], styles)
    else:
        model = tp_deep_mlp(mesh["tp"])
    row = (mesh.get_coordinate()[0], 2)
    if layout == "owner_tp":  # owner mode over the mesh: ddp.dedicate reduces over dp
        from dmuon.integrations import ddp

        ded = ddp.dedicate(model, mesh)
        opt = DMuon(param_groups(model), distributed=ded, rule=rule, **OPT, **RULES[rule])
        return model, opt, row, None
    if layout.startswith("fsdp_tp"):
        for layer in (model.fc1, model.fc2, model.fc3, model.fc4):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = DMuon(param_groups(model), rule=rule, **OPT, **RULES[rule])
        return model, opt, row, None
    dp = mesh["dp"].get_group()
    opt = DMuon(
        param_groups(model), mode="replicated", process_group=dp, rule=rule, **OPT, **RULES[rule]
    )
    return model, opt, row, dp


def train(model, opt, rows, dp, steps) -> None:
    import torch.distributed as dist

    from dmuon.optim.matrix_split import local_tensor

    index, parts = rows
    n = 16 // parts
    for t in steps:
        x, y = deep_batch(t)
        F.mse_loss(model(x[n * index : n * index + n]), y[n * index : n * index + n]).backward()
        if dp is not None:  # DDP's average over dp, shard by shard
            for p in model.parameters():
                g = local_tensor(p.grad)
                dist.all_reduce(g, group=dp)
                g.div_(2)
        opt.step()
        opt.zero_grad()
    exchange = getattr(opt.engine, "exchange", None)
    if exchange is not None:  # owner mode: the last step's shards have arrived
        exchange.wait_all_published()


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def run_save(rank, world, path, layout, rule):
    from dmuon.integrations import checkpoint

    model, opt, rows, dp = build(layout, rule)
    train(model, opt, rows, dp, range(2))
    checkpoint.save(path, model, opt)
    full = checkpoint.full_state_dict(model, opt)
    train(model, opt, rows, dp, range(2, 3))
    if rank == 0:
        torch.save(full, f"{path}.full.pt")
    return full_params(model)


def run_load(rank, world, path, layout, rule):
    from dmuon.integrations import checkpoint

    model, opt, rows, dp = build(layout, rule)
    checkpoint.load(path, model, opt)
    train(model, opt, rows, dp, range(2, 3))
    return full_params(model)


def one_process(path: str, rule: str, how: str) -> dict[str, torch.Tensor]:
    from dmuon.integrations import checkpoint

    model = DeepMLP()
    opt = DMuon(param_groups(model), rule=rule, **OPT, **RULES[rule])
    if how == "dcp":
        checkpoint.load(path, model, opt)
    elif how == "full":
        checkpoint.load_full_state_dict(model, opt, torch.load(f"{path}.full.pt"))
    else:  # the weights only, with a fresh optimizer: what lost state looks like
        checkpoint.load(path, model, DMuon(param_groups(model), rule=rule, **OPT, **RULES[rule]))
        opt = DMuon(param_groups(model), rule=rule, **OPT, **RULES[rule])
    train(model, opt, (0, 1), None, range(2, 3))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close(got, want, what) -> None:
    for name, w in want.items():
        diff = (got[name] - w).abs().max().item()
        assert diff <= SPLIT_TOLERANCE, f"{what}: {name} differs by {diff:.2e}"


# Every rule on FSDP2 over tp (torchtitan's layout; its state also loads into owner
# mode); one rule per other layout, each rule's state layout covered on two of them:
# muon's momentum (one tensor shaped like the shard), normuon's per-row second moment
# (split with the rows, whole with the columns), dion3's state of the gathered matrix.
CASES = [("fsdp_tp", rule) for rule in RULES]
CASES += [("replicated_tp", "normuon")]
# half of the matrices left out of tensor parallelism: owned whole over dp, one copy per
# tp column (the full state dict takes rank 0's column)
CASES += [("fsdp_tp_half", "dion3")]
# owner mode over dp × tp (ddp.dedicate on the mesh): the owner's tp row holds the state
CASES += [("owner_tp", "muon"), ("owner_tp", "normuon")]


@pytest.mark.parametrize(("layout", "rule"), CASES)
def test_owner_held_tensor_parallel_state_resumes_anywhere(tmp_path, layout, rule):
    path = str(tmp_path / "ckpt")
    continued = run_on_ranks(run_save, 4, args=(path, layout, rule), timeout=240)[0]
    lost = one_process(path, rule, "weights only")
    gap = max((lost[n] - w).abs().max().item() for n, w in continued.items())
    assert gap > 100 * SPLIT_TOLERANCE, f"the optimizer state made no difference ({gap:.1e})"
    assert_close(one_process(path, rule, "dcp"), continued, f"{layout} → one process (DCP)")
    assert_close(one_process(path, rule, "full"), continued, f"{layout} → one process (full)")
    targets = [layout, "fsdp_dp4"]  # the same mesh; plain FSDP2 on 4 ranks
    if layout == "fsdp_tp":  # FSDP2 over tp's state into owner mode over the same mesh
        targets.append("owner_tp")
    for target in targets:
        resumed = run_on_ranks(run_load, 4, args=(path, target, rule), timeout=240)
        for rank, got in enumerate(resumed):
            assert_close(got, continued, f"{layout} → {target}, rank {rank}")
