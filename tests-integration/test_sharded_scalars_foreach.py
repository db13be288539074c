"""FSDP2's scalar parameters are stepped by torch's multi-tensor AdamW, bit for bit.

In ``sharded`` mode the scalar parameters (norms, biases) are FSDP2's ``Shard(0)``
DTensors. On a CPU torch's AdamW picks its loop of one call per op and parameter for
them, each call through DTensor's dispatch: five sixths of the step on a model of many
small layers (``benchmarks/step_overhead.py``). DMuon asks for the multi-tensor path
(``scalar._foreach``) when every parameter and gradient is a DTensor on one mesh with
matching placements, as torchtitan's AdamW does. Checked on two gloo ranks: the same
bits as the loop after three steps, with AdamW, plain and cautious decay; and
the path is refused for a mix it cannot take.
"""

from __future__ import annotations

import pytest
import torch
from distributed_cases import OPT, batch, full_params, loss_of, max_diff, setup

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import scalar


def _train(rank: int, world: int, loop: bool, options: dict[str, object]):
    chosen: list[bool | None] = []
    pick = scalar._foreach

    def spy(params, grads):
        chosen.append(pick(params, grads))
        return None if loop else chosen[-1]

    scalar._foreach = spy
    try:
        model, forward, opt, _ = setup("sharded", "gpt", world, dict(OPT, **options))
        for t in range(3):
            loss_of("gpt", forward, *batch("gpt", t, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        scalar._foreach = pick
    return chosen, full_params(model)


@pytest.mark.parametrize(
    "options",
    [{}, {"cautious_weight_decay": True, "adamw_weight_decay": 0.1}],
    ids=["adamw", "adamw-cautious"],
)
def test_fsdp2_scalars_step_by_the_multi_tensor_path_with_the_loops_bits(options):
    fast = run_on_ranks(_train, 2, args=(False, options), timeout=240)
    loop = run_on_ranks(_train, 2, args=(True, options), timeout=240)
    for rank in range(2):
        chosen, weights = fast[rank]
        assert chosen and all(c is True for c in chosen), chosen
        same, where = max_diff(weights, loop[rank][1])
        assert same == 0.0, f"rank {rank}: the multi-tensor path differs at {where}"


def _mixed(rank: int, world: int) -> list[bool | None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    a = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    plain = torch.ones(4)
    return [
        scalar._foreach([a, a], [a, a]),  # one mesh, matching placements
        scalar._foreach([a], [b]),  # a gradient with other placements
        scalar._foreach([a, plain], [a, plain]),  # DTensors beside a plain tensor
        scalar._foreach([plain, plain], [plain, plain]),
    ]


def test_the_multi_tensor_path_is_refused_for_a_mix_it_cannot_take():
    for got in run_on_ranks(_mixed, 2, timeout=120):
        assert got == [True, None, None, True], got
