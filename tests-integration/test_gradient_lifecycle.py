"""Gradients that arrive, are dropped, accumulate or appear late, in owner mode.

Each case found by trying what training loops do (none was covered before):

* **a batch dropped after its backward** (``loss.backward(); opt.zero_grad()``, no
  step): owner mode had launched the batch's reductions during backward, so every
  later backward raised "a second gradient ... arrived after its layer was reduced",
  on every rank, for good. ``DMuon.zero_grad`` now finishes and forgets them: the run
  equals one process that never saw the dropped batch;
* **a parameter that gets gradients only inside ``no_sync()``** (a branch the last
  micro-batch does not use): its accumulated gradient was copied into the owner's
  buffer but the step counted it absent and never stepped it (nor its bias). It is
  now present at the step: the run equals one process on both micro-batches (under
  ``ddp.dedicate`` and ``fsdp.dedicate``, also with ``free_local_grads``), and when the
  dedication's sync condition (DeepSpeed's path) holds the reductions back;
* **a parameter frozen when the optimizer was built, unfrozen later**
  (``param_groups(model, include_frozen=True)``): owner mode never stepped the matrix
  and stepped the bias on each rank's own, unaveraged gradient (the ranks drifted
  apart), replicated mode ignored it. Now the step is refused by name on every rank,
  nothing updated, and the optimizer stays usable;
* **bf16 parameters under FSDP2** (``fsdp.dedicate`` and sharded mode): the first step
  raised in the scalar step's ``torch._foreach_copy_`` on DTensor shards. They now
  train like ``ddp.dedicate``.

Owner-mode comparisons with one process on the same global batch: tolerance 1e-5
(fp32 Newton–Schulz; only the order of the gradient sums differs).
"""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
from distributed_cases import full_params, max_diff
from torch import nn

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

WORLD = 2
OPT = {"lr": 0.02, "adamw_lr": 3e-3, "ns_compute_dtype": "float32"}
TOLERANCE = 1e-5
SETUPS = ("ddp", "ddp_owner_scalars", "ddp_zero3", "fsdp")


class Net(nn.Module):
    """``a → (b) → c``: ``b`` is a branch a forward may skip."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(h + torch.tanh(self.b(h)) if use_b else h)


def data(t: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * t + rank))


def loss(model: nn.Module, t: int, rank: int, use_b: bool = True) -> torch.Tensor:
    return model(data(t, rank), use_b).square().mean()


def dedicated(setup: str, model: nn.Module, world: int):
    """The model dedicated as ``setup`` says, and what to call it through."""
    from dmuon.integrations import ddp, fsdp

    if setup in ("fsdp", "fsdp_free"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        ded = fsdp.dedicate(model, mesh, free_local_grads=setup == "fsdp_free")
        fully_shard(model, mesh=mesh, ignored_params=ded.params)
        return ded
    options = {
        "ddp": {},
        "ddp_owner_scalars": {"scalars": "owner"},
        "ddp_zero3": {"reshard_after_forward": True},
    }[setup]
    return ddp.dedicate(model, **options)


# ---------------------------------------------------------- a batch dropped after backward
def dropped_reference() -> dict[str, torch.Tensor]:
    """Steps 1 and 2 on their global batches; batch 0 never seen."""
    model = Net()
    opt = DMuon(param_groups(model), **OPT)
    for t in (1, 2):
        (sum(loss(model, t, r) for r in range(WORLD)) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def run_dropped(rank: int, world: int, setup: str, clip_first: bool) -> dict[str, object]:
    from dmuon.optim import clip_grad_norm_

    model = Net()
    ded = dedicated(setup, model, world)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    loss(model, 0, rank).backward()
    if clip_first:  # the reductions are finished (flushed) before the batch is dropped
        clip_grad_norm_(opt, 1.0)
    opt.zero_grad()  # drop batch 0: its reductions are finished and forgotten
    for t in (1, 2):
        loss(model, t, rank).backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    return {"params": full_params(model), "taken": opt.steps_taken, "skipped": opt.skipped_steps}


@pytest.mark.parametrize(
    ("setup", "clip_first"), [*((s, False) for s in SETUPS), ("ddp", True), ("fsdp", True)]
)
def test_a_batch_dropped_after_backward_is_forgotten(setup, clip_first):
    expected = dropped_reference()
    args = (setup, clip_first)
    for rank, out in enumerate(run_on_ranks(run_dropped, WORLD, args=args, timeout=120)):
        assert (out["taken"], out["skipped"]) == (2, 0), (rank, out["taken"], out["skipped"])
        diff, where = max_diff(out["params"], expected)
        assert diff <= TOLERANCE, f"{setup}, rank {rank}: {where} differs by {diff:.2e}"


def run_stalled_drop(rank: int, world: int) -> dict[str, object]:
    """Rank 1 stalls outside DMuon before dropping its batch: rank 0's zero_grad, which
    communicates, must give up at DMuon's deadline and say where it was."""
    from dmuon.comm import CollectiveError
    from dmuon.comm.testing import rank_store

    model = Net()
    opt = DMuon(
        param_groups(model),
        distributed=dedicated("ddp", model, world),
        timeout=2.0,
        store=rank_store(),
        **OPT,
    )
    loss(model, 0, rank).backward()
    if rank == 1:
        time.sleep(6)
    t0 = time.monotonic()
    try:
        opt.zero_grad()
    except CollectiveError as err:
        return {"error": str(err), "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_dropped_batch_waits_under_the_step_deadline():
    out = run_on_ranks(run_stalled_drop, WORLD, timeout=60)[0]
    assert out["error"] is not None and "DMuon zero_grad" in out["error"], out["error"]
    assert out["seconds"] < 5, out


def test_a_dropped_batch_forgets_its_unscaling():
    """``opt.unscale_(scaler)`` then ``zero_grad`` (a batch dropped after clipping, as
    Lightning's manual optimization may): the next batch is unscaled again, not stepped
    on scaled gradients."""
    model = Net()
    opt = DMuon(param_groups(model), **OPT)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss(model, 0, 0)).backward()
    opt.unscale_(scaler)
    assert opt.unscaled
    opt.zero_grad()
    assert not opt.unscaled


# ------------------------------------------------- a branch used inside no_sync() only
def branch_reference() -> dict[str, torch.Tensor]:
    """Two micro-batches per step, ``b`` used by the first only, 2 steps."""
    model = Net()
    opt = DMuon(param_groups(model), **OPT)
    for t in range(2):
        for m in range(2):
            losses = [loss(model, 2 * t + m, r, use_b=m == 0) for r in range(WORLD)]
            (sum(losses) / WORLD / 2).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def run_branch(rank: int, world: int, setup: str, how: str) -> dict[str, torch.Tensor]:
    model = Net()
    ded = dedicated(setup, model, world)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    micro = 0
    if how == "sync_condition":  # DeepSpeed's way: asked as each gradient arrives
        ded.exchange.reduction.set_sync_condition(lambda: micro == 1)
    for t in range(2):
        for micro in range(2):
            held = how == "no_sync" and micro == 0
            with ded.no_sync() if held else contextlib.nullcontext():
                (loss(model, 2 * t + micro, rank, use_b=micro == 0) / 2).backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    return full_params(model)


@pytest.mark.parametrize(
    ("setup", "how"),
    [
        ("ddp", "no_sync"),
        ("ddp_owner_scalars", "no_sync"),
        ("ddp", "sync_condition"),
        ("fsdp", "no_sync"),
        ("fsdp_free", "no_sync"),
    ],
)
def test_a_branch_used_only_inside_no_sync_is_stepped(setup, how):
    expected = branch_reference()
    initial = full_params(Net())
    moved = float((expected["b.weight"] - initial["b.weight"]).abs().max())
    assert moved > 1e-3, "the branch barely moved in one process: the test would prove nothing"
    for rank, got in enumerate(run_on_ranks(run_branch, WORLD, args=(setup, how), timeout=120)):
        diff, where = max_diff(got, expected)
        assert diff <= TOLERANCE, f"{setup}/{how}, rank {rank}: {where} differs by {diff:.2e}"


def unsynced_reference() -> dict[str, torch.Tensor]:
    """One step on three micro-batches, ``b`` used by the first two only."""
    model = Net()
    opt = DMuon(param_groups(model), **OPT)
    for m in range(3):
        losses = [loss(model, m, r, use_b=m < 2) for r in range(WORLD)]
        (sum(losses) / WORLD / 3).backward()
    opt.step()
    return full_params(model)


def run_unsynced_recovery(rank: int, world: int, setup: str) -> dict[str, object]:
    """Every micro-batch in no_sync: the step raises; one more backward outside it (not
    reaching ``b``) and the step go on with all three micro-batches' gradients."""
    from dmuon.optim import UnsyncedGradientsError

    model = Net()
    ded = dedicated(setup, model, world)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    with ded.no_sync():
        for m in range(2):
            (loss(model, m, rank) / 3).backward()
    error = None
    try:
        opt.step()
    except UnsyncedGradientsError as err:
        error = str(err)
    (loss(model, 2, rank, use_b=False) / 3).backward()
    opt.step()
    ded.wait()
    return {"error": error, "params": full_params(model), "taken": opt.steps_taken}


@pytest.mark.parametrize("setup", ["ddp", "fsdp_free"])
def test_the_unsynced_step_recovers_with_every_accumulated_gradient(setup):
    """The recovery the error message gives keeps what was accumulated, ``b``'s too
    (before, the error's drain forgot that ``b`` had a gradient, and with
    ``free_local_grads`` it had freed every accumulated gradient)."""
    expected = unsynced_reference()
    for rank, out in enumerate(
        run_on_ranks(run_unsynced_recovery, WORLD, args=(setup,), timeout=120)
    ):
        assert out["error"] is not None and "outside no_sync()" in out["error"], out["error"]
        assert out["taken"] == 1, (rank, out["taken"])
        diff, where = max_diff(out["params"], expected)
        assert diff <= TOLERANCE, f"{setup}, rank {rank}: {where} differs by {diff:.2e}"


# --------------------------------------------- frozen at construction, unfrozen later
def run_thawed(rank: int, world: int, mode: str, users: str) -> dict[str, object]:
    from torch.nn.parallel import DistributedDataParallel

    from dmuon.integrations import ddp
    from dmuon.optim import ThawedParameterError

    model = Net()
    for p in model.b.parameters():
        p.requires_grad_(False)
    groups = param_groups(model, include_frozen=True)
    if mode == "owner":
        forward: nn.Module = model
        opt = DMuon(groups, distributed=ddp.dedicate(model), **OPT)
    else:  # stock DDP, built with the branch frozen as well
        forward = DistributedDataParallel(model)
        opt = DMuon(groups, mode="replicated", **OPT)
    loss(forward, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    for p in model.b.parameters():
        p.requires_grad_(True)
    loss(forward, 1, rank, use_b=users == "all" or rank == 0).backward()
    before = full_params(model)
    out: dict[str, object] = {}
    try:
        opt.step()
        out["error"] = None
    except ThawedParameterError as err:
        out["error"], out["ranks"], out["names"] = str(err), err.ranks, err.names
    out["unchanged"] = max_diff(full_params(model), before)[0] == 0.0
    # frozen again, the optimizer goes on
    for p in model.b.parameters():
        p.requires_grad_(False)
    opt.zero_grad()
    loss(forward, 2, rank).backward()
    opt.step()
    out["after"] = (opt.steps_taken, max_diff(full_params(model), before)[0] > 0)
    return out


@pytest.mark.parametrize(
    ("mode", "users"), [("owner", "all"), ("owner", "rank0"), ("replicated", "rank0")]
)
def test_a_parameter_unfrozen_after_construction_is_refused_on_every_rank(mode, users):
    """``users="rank0"``: the unfrozen branch runs on rank 0 only; rank 1 holds no
    gradient of it and must refuse too (the flag travels in the step's agreement)."""
    results = run_on_ranks(run_thawed, WORLD, args=(mode, users), timeout=120)
    holders = [0, 1] if users == "all" else [0]
    for rank, out in enumerate(results):
        msg = out["error"]
        assert msg is not None, f"rank {rank}: the thawed branch was taken silently"
        assert out["ranks"] == holders, (rank, out["ranks"])
        mine = ["b.weight", "b.bias"] if rank in holders else []
        assert out["names"] == mine, (rank, out["names"])
        assert "did not require a gradient" in msg and f"Mode {mode!r}" in msg, msg
        assert "Nothing was updated on any rank" in msg, msg
        assert out["unchanged"], f"rank {rank}: the refused step changed weights"
        assert out["after"] == (2, True), (rank, out["after"])


# ---------------------------------------------------------------- bf16 under FSDP2
def run_bf16(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import ddp, fsdp

    out = {}
    for setup in ("ddp", "fsdp", "sharded"):
        model = Net().to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (world,))
        if setup == "ddp":
            opt = DMuon(param_groups(model), distributed=ddp.dedicate(model), **OPT)
        elif setup == "fsdp":
            ded = fsdp.dedicate(model, mesh)
            fully_shard(model, mesh=mesh, ignored_params=ded.params)
            opt = DMuon(param_groups(model), distributed=ded, **OPT)
        else:
            fully_shard(model, mesh=mesh)
            opt = DMuon(param_groups(model), mode="sharded", **OPT)
        for t in range(3):
            model(data(t, rank).bfloat16()).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.engine.settle()  # owner mode: the last publications are in
        out[setup] = full_params(model)
    return out


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got − want|`` in bf16 units in the last place of ``want``'s largest entry."""
    top = float(want.float().abs().max())
    spacing = 2.0 ** (math.floor(math.log2(top)) - 7)  # bf16: 8 significant bits
    return float((got.float() - want.float()).abs().max()) / spacing


def test_bf16_parameters_train_under_fsdp2_as_under_ddp_dedicate():
    """bf16 weights, 3 steps. ``fsdp.dedicate`` equals ``ddp.dedicate`` (measured: bit
    for bit); sharded mode averages the bf16 gradients in FSDP2's reduce-scatter, whose
    rounding differs, and may differ by about one bf16 ulp of a matrix's largest weight
    per step (measured: 2 ulps after 3 steps); each weight moved by more than that."""
    initial = full_params(Net().to(torch.bfloat16))
    for rank, out in enumerate(run_on_ranks(run_bf16, WORLD, timeout=120)):
        for name, want in out["ddp"].items():
            assert ulps(want, initial[name]) > 4, f"rank {rank}: {name} barely trained"
            for setup in ("fsdp", "sharded"):
                diff = ulps(out[setup][name], want)
                assert diff <= 3, f"{setup}, rank {rank}: {name} differs by {diff} bf16 ulps"


# --------------------------------- zeros kept by zero_grad(set_to_none=False), no backward
def kept_zeros_reference() -> dict[str, torch.Tensor]:
    """``b`` used at step 0 and by no rank at steps 1 and 2: its gradient stays the zeros
    ``zero_grad(set_to_none=False)`` left, so one process still steps it (its momentum
    moves it on, weight decay shrinks it)."""
    model = Net()
    opt = DMuon(param_groups(model), weight_decay=0.1, **OPT)
    for t in range(3):
        (sum(loss(model, t, r, use_b=t == 0) for r in range(WORLD)) / WORLD).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return full_params(model)


def run_kept_zeros(rank: int, world: int, setup: str) -> dict[str, torch.Tensor]:
    model = Net()
    ded = dedicated(setup, model, world)
    opt = DMuon(param_groups(model), distributed=ded, weight_decay=0.1, **OPT)
    for t in range(3):
        loss(model, t, rank, use_b=t == 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    ded.wait()
    return full_params(model)


@pytest.mark.parametrize("setup", ["ddp", "ddp_owner_scalars", "fsdp"])
def test_a_parameter_no_backward_used_steps_on_its_kept_zeros_like_one_process(setup):
    """Owner mode counted a gradient present only if a backward produced it this step: the
    branch's kept zeros were not stepped (by 1e-2 off one process, its bias too). A held
    ``p.grad`` counts now, as it does for ``torch.optim``."""
    expected = kept_zeros_reference()
    moved = full_params(Net())
    assert (expected["b.weight"] - moved["b.weight"]).abs().max() > 1e-3
    for rank, got in enumerate(run_on_ranks(run_kept_zeros, WORLD, args=(setup,), timeout=120)):
        diff, where = max_diff(got, expected)
        assert diff <= TOLERANCE, f"{setup}, rank {rank}: {where} differs by {diff:.2e}"


# ------------------------------------------------------- a model cast after dedicate()
def run_cast_after(rank: int, world: int, setup: str) -> str:
    model = Net()
    ded = dedicated(setup, model, world)
    model.to(torch.bfloat16)  # the buckets are float32
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    try:
        model(data(0, rank).bfloat16()).square().mean().backward()
        opt.step()
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("setup", ["ddp", "fsdp"])
def test_a_model_cast_after_dedicate_is_refused_by_name_on_every_rank(setup):
    """The first gradient of a dedicated weight cast after ``dedicate()`` is refused, naming
    it and both dtypes (it failed in torch's gradient assignment inside the reduction,
    naming neither the parameter nor the cause)."""
    for rank, err in enumerate(run_on_ranks(run_cast_after, WORLD, args=(setup,), timeout=120)):
        assert "is torch.bfloat16 on cpu but was dedicated as torch.float32" in err, (rank, err)
        assert "before dedicate()" in err, (rank, err)
