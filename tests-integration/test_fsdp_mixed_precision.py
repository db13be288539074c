"""FSDP2's ``MixedPrecisionPolicy`` beside ``fsdp.dedicate``: refused where its cast
cannot reach the dedicated matrices, trained as stock FSDP2 where it can.

The dedicated matrices are ``ignored_params``, outside FSDP2, so a policy's
``param_dtype=torch.bfloat16`` leaves them fp32 while the activations around them are
bf16: without a check the first forward dies in torch's matmul ("self and mat2 must
have the same dtype"), naming neither the parameter nor the cause. Expected on 2 gloo
ranks: that forward raises a ``ValueError`` on every rank naming the policy, a dedicated
matrix, the reason and the remedy (``torch.autocast``), whether ``fully_shard`` ran
after ``dedicate`` (the guide's order) or before it (torchtitan's); the same dedication
then trains under ``torch.autocast`` to the weights of stock FSDP2 (``mode="sharded"``)
under the same policy and autocast. The policies that work without autocast
(``reduce_dtype`` alone, ``param_dtype`` equal to the parameters') still train to stock
FSDP2's weights, so the check refuses only what cannot run.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks

WORLD, STEPS = 2, 3
TOLERANCE = 1e-5
BF16, FP32 = torch.bfloat16, torch.float32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def _build(owner: bool, policy: dict, order: str = "after") -> tuple[nn.Module, object, object]:
    """Model, optimizer and dedication (``None`` for stock FSDP2) under ``policy``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dmuon.integrations import fsdp
    from dmuon.optim import DMuon, param_groups

    model, mp = _model(), MixedPrecisionPolicy(**policy)
    if not owner:
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, DMuon(param_groups(model), mode="sharded", lr=0.02), None

    def shard(ignored: set) -> None:
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=mp, ignored_params=ignored)
        fully_shard(model, mp_policy=mp, ignored_params=ignored)

    if order == "before":  # torchtitan's order: FSDP2 first, the matrices left out
        shard({model[0].weight, model[2].weight})
        ded = fsdp.dedicate(model)
    else:  # the guide's order
        ded = fsdp.dedicate(model)
        shard(set(ded.params))
    return model, DMuon(param_groups(model), distributed=ded, lr=0.02), ded


def _train(model, opt, ded, autocast: bool) -> dict[str, torch.Tensor]:
    """``STEPS`` steps on this rank's batches; every parameter whole afterwards."""
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(STEPS):
        x = torch.randn(4, 16, generator=g)
        ctx = torch.autocast("cpu", dtype=BF16) if autocast else contextlib.nullcontext()
        with ctx:
            y = model(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    if ded is not None:
        ded.wait()
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _refused_then_autocast(rank: int, world: int) -> dict[str, tuple]:
    return {order: _one_order(order) for order in ("after", "before")}


def _one_order(order: str) -> tuple:
    policy = dict(param_dtype=BF16, reduce_dtype=FP32)
    model, opt, ded = _build(True, policy, order)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        model(torch.randn(4, 16))
        message = None
    except ValueError as err:
        message = str(err)
    untouched = all(
        torch.equal(
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach(),
            before[n].full_tensor() if hasattr(before[n], "full_tensor") else before[n],
        )
        for n, p in model.named_parameters()
    )
    owner = _train(model, opt, ded, autocast=True)
    stock = _train(*_build(False, policy), autocast=True)
    gap = max((owner[n] - stock[n]).abs().max().item() for n in stock)
    return message, untouched, gap


def test_param_dtype_cast_refused_on_every_rank_then_autocast_trains_as_stock():
    runs = run_on_ranks(_refused_then_autocast, WORLD, timeout=180)
    for order in ("after", "before"):
        outs = [run[order] for run in runs]
        for rank, (message, untouched, gap) in enumerate(outs):
            where = f"rank {rank}, fully_shard {order} dedicate"
            assert message is not None, f"{where}: the bf16 forward was not refused"
            for words in (
                "param_dtype=torch.bfloat16",
                "reduce_dtype=torch.float32",
                "'0.weight'",
                "ignored_params",
                "does not reach",
                "torch.autocast('cpu', dtype=torch.bfloat16)",
                "without param_dtype",
            ):
                assert words in message, f"{where}: {words!r} not in {message!r}"
            assert untouched, f"{where}: the refused forward changed a parameter"
            assert gap < TOLERANCE, f"{where}: under autocast, {gap:.2e} from stock FSDP2"
        assert outs[0][0] == outs[1][0], "the ranks refused with different messages"


WORKING = {
    "reduce_dtype=fp32": dict(reduce_dtype=FP32),
    "param_dtype=fp32": dict(param_dtype=FP32, reduce_dtype=FP32),
    "output_dtype=fp32": dict(output_dtype=FP32),
}


def _working(rank: int, world: int):
    gaps = {}
    for name, policy in WORKING.items():
        owner = _train(*_build(True, policy), autocast=False)
        stock = _train(*_build(False, policy), autocast=False)
        gaps[name] = max((owner[n] - stock[n]).abs().max().item() for n in stock)
    return gaps


def test_policies_without_a_cast_train_as_stock_fsdp2():
    for rank, gaps in enumerate(run_on_ranks(_working, WORLD, timeout=180)):
        for name, gap in gaps.items():
            assert gap < TOLERANCE, f"rank {rank}, {name}: {gap:.2e} from stock FSDP2"


def _nested_unit(rank: int, world: int) -> tuple[str, int]:
    """A ``fully_shard`` unit of its own around the LayerNorm, with a bf16 ``param_dtype``
    that hands fp32 on (``output_dtype``), and the dedicated matrices under the root unit
    (no policy): the unit's cast reaches no dedicated matrix."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dmuon.integrations import fsdp
    from dmuon.optim import DMuon, param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 4))
    ded = fsdp.dedicate(model, layer_pack_mb=0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, ignored_params=set(ded.params))
    opt = DMuon(param_groups(model), distributed=ded, lr=0.02)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except ValueError as err:
        return f"refused: {err}", opt.steps_taken
    ded.wait()
    return "trained", opt.steps_taken


def test_a_policy_of_a_unit_holding_no_dedicated_matrix_is_not_refused():
    """Each unit's ``param_dtype`` is compared with the dedicated matrices of that unit
    only (not those of its parent or of a nested unit). Before, the LayerNorm unit's
    policy was compared with every dedicated matrix of the model and refused this
    setup, which trains."""
    for rank, (outcome, steps) in enumerate(run_on_ranks(_nested_unit, WORLD, timeout=180)):
        assert outcome == "trained" and steps == 2, (rank, outcome[:300])
