"""Non-finite gradients never reach a weight; zero and underflowing gradients are safe.

* A NaN (or Inf) gradient on one rank only: with ``nonfinite="skip_step"`` every rank
  skips that step — weights and optimizer state untouched, ``skipped_steps`` counts
  it — and training goes on; with ``nonfinite="raise"`` every rank raises
  :class:`~dmuon.optim.NonFiniteGradientError` naming the rank, nothing changes, and
  the optimizer stays usable. The proof: the distributed run over batches 0, 1
  (poisoned on rank 1), 2 ends equal to a single process trained on batches 0 and 2
  only, in owner (FSDP2 and DDP replacement), replicated and sharded mode.
* A zero gradient gives a zero update in every rule and every float dtype (no 0/0).
* A huge finite gradient (1e38 in fp32) keeps the momentum and every weight finite
  in every rule (the sum-form momentum saturates instead of overflowing).
* A gradient whose Frobenius norm underflows in the compute dtype (fp16 entries of
  1e-7, bf16 entries of 1e-38, fp32 entries of 1e-30 with fp16/bf16 Newton–Schulz)
  gives a finite update — for Muon the same as for the gradient scaled to O(1),
  since the polar factor does not depend on the scale.
"""

from __future__ import annotations

import pytest
import torch
from distributed_cases import OPT, batch, build, full_params, loss_of, max_diff, setup

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import RULES, DMuon, NonFiniteGradientError, param_groups

NAME = "mixed"
MODES = ["owner_fsdp", "owner_fsdp_z3", "owner_ddp", "replicated", "sharded"]
BATCHES = [0, 1, 2]
POISONED = 1  # batch 1 is poisoned on rank 1
TOLERANCE = 1e-5  # as in test_modes_equal_single: only the order of the sums differs


def reference_without_poisoned_batch(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build(NAME)
    opt = DMuon(param_groups(model), **OPT)
    for t in BATCHES:
        if t == POISONED:
            continue
        losses = [loss_of(NAME, model, *batch(NAME, t, r, world)) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def run_poisoned(rank: int, world: int):
    out = {}
    for policy in ("skip_step", "raise"):
        for mode in MODES:
            model, forward, opt, ded = setup(mode, NAME, world, dict(OPT, nonfinite=policy))
            raised = None
            for t in BATCHES:
                x, y = batch(NAME, t, rank, world)
                if t == POISONED and rank == 1:
                    x = x.clone()
                    x[0, 0, 0] = float("nan") if policy == "skip_step" else float("inf")
                loss_of(NAME, forward, x, y).backward()
                if t == POISONED:
                    if ded is not None:  # ZeRO-3-like: bring back the weights to read them
                        ded.wait()
                    before = full_params(model)
                    state = {k: v.clone() for p in opt.state for k, v in opt.state[p].items()}
                try:
                    opt.step()
                except NonFiniteGradientError as err:
                    raised = (str(err), err.ranks)
                if t == POISONED:
                    if ded is not None:
                        ded.wait()
                    same, where = max_diff(full_params(model), before)
                    after = {k: v for p in opt.state for k, v in opt.state[p].items()}
                    state_same = all(torch.equal(state[k], after[k]) for k in state)
                opt.zero_grad()
            if ded is not None:
                ded.wait()
            out[policy, mode] = {
                "params": full_params(model),
                "skipped": opt.skipped_steps,
                "raised": raised,
                "unchanged": same == 0.0 and state_same,
                "where": where,
            }
    return out


@pytest.mark.parametrize("world", [3])
def test_a_nan_or_inf_gradient_on_one_rank_skips_or_raises_on_every_rank(world):
    expected = reference_without_poisoned_batch(world)
    results = run_on_ranks(run_poisoned, world, timeout=240)
    for rank, res in enumerate(results):
        for (policy, mode), r in res.items():
            where = f"{policy}, {mode}, rank {rank}"
            assert r["unchanged"], f"{where}: the poisoned step changed {r['where']} or state"
            if policy == "skip_step":
                assert r["skipped"] == 1 and r["raised"] is None, where
            else:
                assert r["skipped"] == 0 and r["raised"] is not None, where
                text, ranks = r["raised"]
                # where gradients are still local (DDP replacement) only rank 1 has it;
                # after DDP's all-reduce or FSDP2's reduce-scatter every rank does
                local = mode == "owner_ddp"
                assert (ranks == [1]) if local else (1 in ranks), f"{where}: {ranks}"
                assert f"rank(s) {ranks}" in text, f"{where}: {text}"
            diff, name = max_diff(r["params"], expected)
            assert diff <= TOLERANCE, f"{where}: {name} differs by {diff:.2e} from the reference"


def _dtypes(rule: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_zero_gradients_give_zero_updates_in_every_rule(rule):
    for dtype in _dtypes(rule):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6, 10, dtype=dtype))
        start = w.detach().clone()
        opt = DMuon([w], rule=rule, lr=0.05, weight_decay=0.0, nonfinite=None)
        for _ in range(3):
            w.grad = torch.zeros_like(w)
            opt.step()
        assert torch.equal(w.detach(), start), f"{rule}, {dtype}: a zero gradient moved w"
        for key, value in opt.state[w].items():
            assert torch.isfinite(value).all(), f"{rule}, {dtype}: state {key!r} not finite"


UNDERFLOW = [
    # parameter dtype, gradient scale, Newton–Schulz compute dtype
    (torch.float16, 1e-7, None),  # ‖G‖² ≈ 1e-12: 0 in fp16
    (torch.bfloat16, 1e-38, None),  # ‖G‖² ≈ 1e-74: 0 in bf16 (and fp32)
    (torch.float32, 1e-30, "float16"),  # below fp16's smallest subnormal
    (torch.float32, 1e-38, "bfloat16"),
]


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize(("dtype", "scale", "compute"), UNDERFLOW)
def test_a_gradient_whose_norm_underflows_gives_a_finite_update(rule, dtype, scale, compute):
    torch.manual_seed(0)
    direction = torch.randn(6, 10)
    kw = {} if compute is None else {"ns_compute_dtype": compute}
    w = torch.nn.Parameter(torch.randn(6, 10, dtype=dtype))
    start = w.detach().float().clone()
    opt = DMuon([w], rule=rule, lr=0.05, weight_decay=0.0, nonfinite=None, **kw)
    w.grad = (direction * scale).to(dtype)
    # the direction the tiny gradient can represent (fp16/bf16 subnormals are coarse)
    represented = w.grad.double() / scale
    assert represented.abs().max() > 0, "the test gradient itself rounded to zero"
    opt.step()
    assert torch.isfinite(w).all(), f"{rule}: a tiny gradient gave a non-finite weight"
    if rule != "muon":
        return
    # Muon's step depends on the direction only: compare with the O(1) gradient.
    v = torch.nn.Parameter(start.to(dtype).clone())
    ref = DMuon([v], rule=rule, lr=0.05, weight_decay=0.0, **kw)
    v.grad = represented.to(dtype)
    ref.step()
    moved, expected = w.detach().float() - start, v.detach().float() - start
    assert expected.abs().max() > 0
    # Same direction, so the same update up to rounding: one ulp of the weights
    # (|w| < 4: 2⁻⁸ in fp16, 2⁻⁶ in bf16) or of bf16/fp16 Newton–Schulz for fp32.
    atol = {torch.float16: 2**-8, torch.bfloat16: 2**-6}.get(dtype, 2e-3)
    torch.testing.assert_close(moved, expected, atol=atol, rtol=0.0)


HUGE = 1e38  # finite in fp32 (max 3.4e38); the sum-form momentum reaches |G|/(1 − μ) = 2e39


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("nesterov", [True, False])
def test_a_huge_finite_gradient_keeps_momentum_and_weights_finite(rule, nesterov):
    # Before: the sum-form momentum overflowed on step 3 (step 4 for Dion2/Dion3's
    # error feedback), the guard saw only finite gradients, and every weight became NaN.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 10))
    kw = {"nesterov": nesterov} if "nesterov" in RULES[rule].reads else {}
    opt = DMuon([w], rule=rule, lr=0.05, weight_decay=0.0, **kw)
    direction = torch.randn(6, 10).sign()
    for step in range(1, 6):
        w.grad = direction * HUGE
        opt.step()
        assert torch.isfinite(w).all(), f"{rule}: a non-finite weight after step {step}"
        momentum = opt.state[w]["momentum_buffer"]
        assert torch.isfinite(momentum).all(), f"{rule}: non-finite momentum, step {step}"
    if rule != "muon":
        return
    # Every entry of the momentum saturates alike, so its direction is the gradient's:
    # Muon's step (scale-free) is the one of the O(1) gradient ``direction``.
    torch.manual_seed(0)
    v = torch.nn.Parameter(torch.randn(6, 10))
    ref = DMuon([v], rule=rule, lr=0.05, weight_decay=0.0, **kw)
    for _ in range(5):
        v.grad = direction.clone()
        ref.step()
    torch.testing.assert_close(w.detach(), v.detach(), atol=1e-5, rtol=0.0)  # fp32 NS rounding


def test_the_policy_and_its_count_survive_a_deep_copy():
    import copy

    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = DMuon([w], nonfinite="skip_step", check_every=3, timeout=5)
    w.grad = torch.full((4, 4), float("nan"))
    opt.step()
    twin = copy.deepcopy(opt)
    assert (twin.nonfinite, twin.check_every, twin.timeout) == ("skip_step", 3, 5.0)
    assert (twin.skipped_steps, twin.steps_taken) == (1, 0)
    twin.param_groups[0]["params"][0].grad = torch.full((4, 4), float("inf"))
    twin.step()  # skipped, not raised: the copy kept the policy
    assert twin.skipped_steps == 2


def _half_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)
    ).to(dtype)


def _half_tokens(step: int, rank: int) -> torch.Tensor:
    # tokens 0..7 only: embedding rows 8..15 get an exactly zero gradient
    return torch.randint(0, 8, (2, 5), generator=torch.Generator().manual_seed(10 * step + rank))


def run_half_precision(rank: int, world: int, dtype: torch.dtype):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dmuon.integrations import ddp

    out = {}
    for mode in ("replicated", "owner_ddp_sharded_adamw"):
        model = _half_model(dtype)
        forward: torch.nn.Module = model
        if mode == "replicated":
            forward, kw = DDP(model), {"mode": "replicated"}
        else:  # AdamW state sharded over the ranks: fp32 state and fp32 placeholders
            kw = {"distributed": ddp.dedicate(model, scalars="owner")}
        opt = DMuon(param_groups(model), lr=0.02, nonfinite="raise", **kw)
        for t in range(3):  # before: NaN weights after step 1, NonFiniteGradientError at 2
            forward(_half_tokens(t, rank)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        if "distributed" in kw:
            kw["distributed"].wait()  # the last publications, before reading the weights
        out[mode] = {
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "state_dtypes": sorted(  # of the scalar optimizer (matrices keep their dtype)
                {
                    str(v.dtype)
                    for g in opt.param_groups
                    if g["rule"] == "adamw"
                    for p in g["params"]
                    for k, v in opt.state[p].items()
                    if k != "step"
                }
            ),
        }
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_train_finite_on_two_ranks(dtype):
    results = run_on_ranks(run_half_precision, 2, args=(dtype,), timeout=120)
    # the reference: one process on both ranks' tokens
    model = _half_model(dtype)
    opt = DMuon(param_groups(model), lr=0.02, nonfinite="raise")
    for t in range(3):
        losses = [model(_half_tokens(t, r)).float().square().mean() for r in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
    for mode, r in results[0].items():
        assert r["state_dtypes"] == ["torch.float32"], (mode, r["state_dtypes"])
        for name, p in model.named_parameters():
            got = r["params"][name]
            assert torch.isfinite(got).all(), f"{mode}: {name} not finite"
            assert torch.equal(got, results[1][mode]["params"][name]), f"{mode}: ranks differ"
            # one ulp of |w| < 4 in the dtype: the ranks sum gradients in another order
            atol = {torch.float16: 2**-8, torch.bfloat16: 2**-5}[dtype]
            torch.testing.assert_close(got, p.detach().float(), atol=atol, rtol=0.0)
