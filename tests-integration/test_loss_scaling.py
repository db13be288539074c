"""fp16 loss scaling in owner mode equals one process with ``torch.amp.GradScaler``.

Owner mode reduces each matrix's gradient to its owner during backward, so the
scaler must unscale, and look for an Inf in, the gradients the step reads:
``opt.unscale_(scaler)`` finishes the reductions first, and ``ShardedGradScaler``
sums the Inf flags of the ranks. Two ranks train 6 steps with dynamic loss scaling
(``growth_interval=2``: the scale grows during the run); at step 3 rank 1 alone gets
an infinite loss (its local gradients non-finite, rank 0's finite). Expected, against
the same global batches in one process with a plain ``GradScaler``: the same
parameters (1e-5), the same scale after every step on both ranks (the Inf step
skipped, backed off, alike), the Inf step counted in ``skipped_steps``. The scalar
parameters all-reduced or dedicated too; with DMuon's clipping between unscale and
step too. Under FSDP2 (DTensor scalars beside the owners' plain matrices) it is
refused: torch's scalers cannot unscale the two kinds in one foreach call. The steps a
scaler cannot serve in owner mode are refused on every rank, leave the optimizer usable
and change nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks

WORLD, STEPS, INF_STEP, ROWS = 2, 6, 3, 4
SCALER = dict(init_scale=2.0**8, growth_interval=2)
MAX_NORM = 0.5
TOLERANCE = 1e-5


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def loss_of(m: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    loss = F.mse_loss(m(x), y)
    return loss * float("inf") if (step, rank) == (INF_STEP, 1) else loss


def options():
    return dict(lr=0.02, ns_compute_dtype=torch.float32)


def scaled_steps(opt, scaler, loss_at, unscale, clip=None) -> list[float]:
    """``STEPS`` loss-scaled steps: ``loss_at(t)`` scaled and backpropagated, ``unscale()``,
    ``clip()`` if given, ``scaler.step``, ``scaler.update``; the scale after each."""
    scales = []
    for t in range(STEPS):
        scaler.scale(loss_at(t)).backward()
        unscale()
        if clip is not None:
            clip()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    return scales


def reference(clip: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    from dmuon.optim import DMuon, param_groups

    m = model()
    opt = DMuon(param_groups(m), **options())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scales = scaled_steps(
        opt,
        scaler,
        lambda t: sum(loss_of(m, t, r) for r in range(WORLD)) / WORLD,
        lambda: scaler.unscale_(opt),
        (lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)) if clip else None,
    )
    return {n: p.detach().clone() for n, p in m.named_parameters()}, scales


def train(rank: int, world: int, scalars: str, clip: bool) -> dict[str, object]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, clip_grad_norm_, param_groups

    m = model()
    ded = ddp.dedicate(m, scalars=scalars)
    opt = DMuon(param_groups(m), distributed=ded, **options())
    scaler = ShardedGradScaler(device="cpu", **SCALER)

    def unscale() -> None:
        assert not opt.unscaled, "unscaled before unscale_"
        opt.unscale_(scaler)
        assert opt.unscaled, "DMuon.unscaled is False after unscale_"

    scales = scaled_steps(
        opt,
        scaler,
        lambda t: loss_of(m, t, rank),
        unscale,
        (lambda: clip_grad_norm_(opt, MAX_NORM)) if clip else None,
    )
    assert not opt.unscaled, "DMuon.unscaled outlived its step"
    ded.wait()
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    return {"params": params, "scales": scales, "skipped": opt.skipped_steps, "mode": opt.mode}


@pytest.mark.parametrize(
    ("scalars", "clip"),
    [("all_reduce", False), ("owner", False), ("all_reduce", True)],
)
def test_loss_scaling_in_owner_mode_equals_one_process(scalars, clip):
    expected, scales = reference(clip)
    assert scales[INF_STEP] < scales[INF_STEP - 1], "the Inf step did not back off"
    assert max(scales) > SCALER["init_scale"], "the scale never grew: growth is untested"
    initial = dict(model().named_parameters())
    moved = max(float((expected[n] - initial[n].detach()).abs().max()) for n in expected)
    assert moved > 1e-2, "the reference barely trained: the comparison would prove nothing"
    for rank, out in enumerate(run_on_ranks(train, WORLD, args=(scalars, clip), timeout=120)):
        assert out["mode"] == "owner"
        assert out["scales"] == scales, f"rank {rank}: scales {out['scales']} != {scales}"
        assert out["skipped"] == 1, f"rank {rank}: skipped {out['skipped']} steps"
        for name, want in expected.items():
            diff = float((out["params"][name] - want).abs().max())
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def refusals(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    m = model()
    ded = ddp.dedicate(m)
    opt = DMuon(param_groups(m), distributed=ded, **options())
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    out: dict[str, str] = {}
    for how in ("no_unscale", "scaler_unscale"):
        scaler = ShardedGradScaler(device="cpu", **SCALER)
        scaler.scale(loss_of(m, 0, rank)).backward()
        if how == "scaler_unscale":
            scaler.unscale_(opt)  # this rank's local copies: the owners' gradients stay scaled
        try:
            scaler.step(opt)
            out[how] = "stepped"
        except RuntimeError as err:
            out[how] = str(err)
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
        opt.zero_grad()
    ded.wait()
    out["unchanged"] = str(all(torch.equal(p, before[n]) for n, p in m.named_parameters()))
    # still usable: a served step updates
    scaler = ShardedGradScaler(device="cpu", **SCALER)
    scaler.scale(loss_of(m, 1, rank)).backward()
    opt.unscale_(scaler)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    ded.wait()
    out["then_steps"] = str(any(not torch.equal(p, before[n]) for n, p in m.named_parameters()))
    plain = torch.amp.GradScaler("cpu", **SCALER)
    plain.scale(loss_of(m, 2, rank)).backward()
    try:
        opt.unscale_(plain)
        out["plain_scaler"] = "unscaled"
    except TypeError as err:
        out["plain_scaler"] = str(err)
    opt.step()  # the step the loop would have taken: unscale_ refused before changing anything
    opt.zero_grad()
    narrow = ShardedGradScaler(device="cpu", process_group=dist.new_group([0]), **SCALER)
    narrow.scale(loss_of(m, 4, rank)).backward()
    try:
        opt.unscale_(narrow)
        out["narrow_group"] = "unscaled"
    except ValueError as err:
        out["narrow_group"] = str(err)
    opt.step()
    ded.wait()
    out["skipped"] = str(opt.skipped_steps)
    return out


def train_stock(rank: int, world: int, mode: str) -> dict[str, object]:
    """``replicated`` under stock DDP with torch's ``GradScaler`` and ``sharded`` under
    stock FSDP2 with ``ShardedGradScaler``: torch's own recipe, ``scaler.unscale_(opt)``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.nn.parallel import DistributedDataParallel

    from dmuon.optim import DMuon, param_groups

    m = model()
    if mode == "replicated":  # the DDP all-reduce gives every rank the Inf
        forward: nn.Module = DistributedDataParallel(m)
        scaler = torch.amp.GradScaler("cpu", **SCALER)
    else:  # DTensor shards: the Inf flags summed by ShardedGradScaler
        fully_shard(m)
        forward, scaler = m, ShardedGradScaler(device="cpu", **SCALER)
    opt = DMuon(param_groups(m), mode=mode, **options())
    scales = scaled_steps(
        opt, scaler, lambda t: loss_of(forward, t, rank), lambda: scaler.unscale_(opt)
    )
    params = {n: _whole(p).clone() for n, p in m.named_parameters()}
    return {"params": params, "scales": scales, "mode": opt.mode}


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_stock_ddp_and_fsdp2_loss_scaling_equals_one_process(mode):
    """Where the gradients are all-reduced (DDP) or DTensor shards (FSDP2), torch's own
    recipe serves: the step is skipped (not called) on every rank alike."""
    expected, scales = reference(clip=False)
    for rank, out in enumerate(run_on_ranks(train_stock, WORLD, args=(mode,), timeout=120)):
        assert out["mode"] == mode
        assert out["scales"] == scales, f"{mode}, rank {rank}: scales {out['scales']}"
        for name, want in expected.items():
            diff = float((out["params"][name] - want).abs().max())
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {name} differs by {diff:.2e}"


def sign_mode(rank: int, world: int) -> dict[str, object]:
    """Sign-Muon's mode: each rank's gradients are its own, so only rank 1 sees the Inf."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from dmuon.optim import DMuon, param_groups

    m = model()
    opt = DMuon(param_groups(m), rule="sign_muon", mode="sign", **options())
    plain = torch.amp.GradScaler("cpu", **SCALER)
    plain.scale(loss_of(m, 0, rank)).backward()
    try:
        opt.unscale_(plain)
        refused = "unscaled"
    except TypeError as err:
        refused = str(err)
    opt.zero_grad()
    scaler = ShardedGradScaler(device="cpu", **SCALER)
    scales = scaled_steps(opt, scaler, lambda t: loss_of(m, t, rank), lambda: opt.unscale_(scaler))
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    return {"refused": refused, "scales": scales, "skipped": opt.skipped_steps, "params": params}


def test_sign_mode_skips_and_scales_alike_on_every_rank():
    """Before, a plain ``GradScaler`` skipped the Inf step on rank 1 alone: the ranks then
    stepped on different iterations' gradients and their scales drifted (256 vs 128)
    until a collective timed out."""
    (a, b) = run_on_ranks(sign_mode, WORLD, timeout=120)
    for out in (a, b):
        assert "sign mode needs a ShardedGradScaler" in out["refused"], out["refused"]
        assert out["skipped"] == 1, out["skipped"]
        assert out["scales"][INF_STEP] < out["scales"][INF_STEP - 1], out["scales"]
    assert a["scales"] == b["scales"]
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), f"the ranks' {name} differ"


def skip_agreement(rank: int, world: int) -> list[list[int]]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups
    from dmuon.optim.engine import agree_step

    m = model()
    opt = DMuon(param_groups(m), distributed=ddp.dedicate(m), **options())
    out = []
    for skipper in (1, None):
        F.mse_loss(m(batch(0, rank)[0]), batch(0, rank)[1]).backward()
        _, _, skipping = agree_step(opt.engine, 1, check_finite=False, skip=rank == skipper)
        out.append(skipping)
        opt.engine.skip_step()
        opt.zero_grad()
    return out


def test_one_ranks_skip_is_every_ranks():
    """The step's agreement carries each rank's scaler skip: the ranks step or skip
    together even if their scalers' flags were to differ (a narrower scaler group, which
    ``opt.unscale_`` refuses, since its scale updates would still differ)."""
    for out in run_on_ranks(skip_agreement, WORLD, timeout=120):
        assert out == [[1], []], out


def _fsdp2(m: nn.Module, world: int):
    """``m`` with its matrices dedicated (``fsdp.dedicate``) and the rest FSDP2-sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp
    from dmuon.optim import DMuon, param_groups

    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(m, mesh)
    fully_shard(m, mesh=mesh, ignored_params=ded.params)
    return DMuon(param_groups(m), distributed=ded, **options()), ded


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()


def fsdp2_refusal(rank: int, world: int) -> str:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    m = model()
    opt, ded = _fsdp2(m, world)
    before = {n: _whole(p).clone() for n, p in m.named_parameters()}
    scaler = ShardedGradScaler(device="cpu", **SCALER)
    scaler.scale(loss_of(m, 0, rank)).backward()
    try:
        opt.unscale_(scaler)
        message = "unscaled"
    except NotImplementedError as err:
        message = str(err)
    opt.step()  # the step the loop would have taken: unscale_ refused before changing anything
    ded.wait()
    assert any(not torch.equal(_whole(p), before[n]) for n, p in m.named_parameters())
    return message


def test_fsdp2_owner_mode_refuses_loss_scaling_before_changing_anything():
    for message in run_on_ranks(fsdp2_refusal, WORLD, timeout=120):
        assert "DTensor parameters" in message and "bf16" in message, message


def test_what_owner_mode_cannot_serve_is_refused_on_every_rank():
    for out in run_on_ranks(refusals, WORLD, timeout=120):
        assert "still-scaled gradients" in out["no_unscale"], out["no_unscale"]
        assert "before their reductions" in out["scaler_unscale"], out["scaler_unscale"]
        for how in ("no_unscale", "scaler_unscale"):
            assert "opt.unscale_(scaler)" in out[how] and "Nothing was updated" in out[how]
        assert "owner mode needs a ShardedGradScaler" in out["plain_scaler"]
        assert "process_group spans" in out["narrow_group"], out["narrow_group"]
        assert out["unchanged"] == "True" and out["then_steps"] == "True", out
        assert out["skipped"] == "2", out
