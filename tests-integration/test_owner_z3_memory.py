"""Under ZeRO-3-like owner mode (``reshard_after_forward=True``) a layer's reduce buckets
exist only from its launch until its reduction is waited on, and the planner's
``owner-z3`` buffers are their peak.

The buckets were made for every layer at ``dedicate()`` and kept: ``Φ_M e`` held between
steps and through the next forward, where the mode saves the weights, while the planner
counted one layer's (``ℓe``). Measured on real gloo ranks: the bytes of the storages of
the layer records' reduce buckets between steps, during the next forward and at the end
of backward (there: every layer launched, ``Φ_M e``, which is now the planner's figure,
and the matrices' bytes counted from the model), and every live tensor storage (found
by the garbage collector, each once) after each step, which must not grow.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks

D, LAYERS = 32, 4


def bucket_bytes(ded: object) -> int:
    """The storage bytes of every layer record's reduce buckets, each storage once."""
    seen = {
        b.buffer.untyped_storage().data_ptr(): b.buffer.untyped_storage().nbytes()
        for layer in ded.exchange.layers  # type: ignore[attr-defined]
        for b in layer.reduce_buckets
    }
    return sum(seen.values())


def live_bytes() -> int:
    """Every live tensor's storage bytes, each storage once."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # no data (a FakeTensor left by a torch.compile of the parent)
                continue
    return sum(seen.values())


def run(rank: int, world: int) -> dict[str, int | float]:
    import torch.distributed as dist

    from dmuon.integrations import fsdp
    from dmuon.optim import DMuon, param_groups
    from dmuon.optim.planner.config import spec_from_module
    from dmuon.optim.planner.memory import memory_per_rank

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(D, D, bias=False) for _ in range(LAYERS)))
    spec = spec_from_module(model)
    matrix_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ded = fsdp.dedicate(model, reshard_after_forward=True)
    opt = DMuon(param_groups(model), distributed=ded, lr=0.01)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
    during_forward: list[int] = []
    model[-1].register_forward_hook(lambda *_: during_forward.append(bucket_bytes(ded)))
    out: dict[str, int | float] = {}
    for step in range(2):
        model(x).square().mean().backward()
        out["after_backward"] = bucket_bytes(ded)
        opt.step()
        opt.zero_grad()
        out["between_steps"] = bucket_bytes(ded)
        out[f"live_{step}"] = live_bytes()
    out["during_forward"] = max(during_forward)
    out["matrix_bytes"] = matrix_bytes
    out["planned"] = memory_per_rank(spec, ded.exchange.plan, "owner-z3")["buffers"]
    dist.barrier()
    return out


def test_zero3_reduce_buckets_live_from_launch_to_step_as_planned() -> None:
    for rank, out in enumerate(run_on_ranks(run, 2, timeout=120)):
        # none held between steps or while the next forward runs (was Φ_M e)
        assert out["between_steps"] == 0, (rank, out)
        assert out["during_forward"] == 0, (rank, out)
        # at the end of backward every layer was launched: Φ_M e, the planner's figure
        assert out["after_backward"] == out["matrix_bytes"] == out["planned"], (rank, out)
        # nothing piles up from one step to the next
        assert out["live_1"] == out["live_0"], (rank, out)
