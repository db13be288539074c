"""Optimizer state stays finite for every finite gradient, in the dtype it is *stored* in.

A finite gradient spike whose square overflows used to leave an ``inf`` second moment
that never came back (``β₂·inf = inf``): that entry's update was 0 for the rest of the
run and every checkpoint held ``inf``. Two ways it got there:

* the matrix rules' second moments (Muon², AdaMuon, NorMuon) saturated their fp32
  working copy at fp32's max, then stored it into a bf16/fp16 state, where that max
  rounds to ``inf`` (bf16's max, 3.39e38, is below fp32's 3.40e38);
* the scalar optimizers (AdamW, Lion) did not saturate at all (nor does
  ``torch.optim.AdamW``): a gradient entry of 2e19 squares past fp32's range.

References are computed another way: the EMA written out by hand, and
``torch.optim.AdamW`` itself for every entry that did not overflow.
"""

import pytest
import torch

from dmuon.optim import DMuon, get_scalar_rule
from dmuon.optim.scalar import adamw_step, scalar_state_shapes
from dmuon.optim.transforms import (
    AdamPrecondition,
    ElementwiseNormalize,
    RowNormalize,
    StepContext,
)

F32_MAX = torch.finfo(torch.float32).max


def _muon2_spike_run(dtype: torch.dtype, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Muon² on one ``(4, 6)`` matrix: one gradient entry of 1e30 (finite in bf16), then
    ``steps`` normal steps. Returns ``V`` right after the spike and at the end (fp32)."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 6, generator=g).to(dtype))
    opt = DMuon([p], rule="muon2", lr=0.02, beta2=0.5)
    spike = torch.randn(4, 6, generator=g)
    spike[1, 2] = 1e30
    p.grad = spike.to(dtype)
    opt.step()
    V = opt.state[p]["grad_second_moment"]
    assert V.dtype == dtype  # the state of a bf16 matrix is bf16 (no state_dtype)
    after_spike = V.float().clone()
    for _ in range(steps):
        p.grad = torch.randn(4, 6, generator=g).to(dtype)
        opt.step()
    assert torch.isfinite(p).all()
    return after_spike, V.float().clone()


def test_a_gradient_spike_leaves_a_bf16_muon2_second_moment_finite_and_decaying():
    """The spike saturates at bf16's own max (stored exactly), not fp32's (which rounds
    to ``inf`` in bf16 and stayed ``inf`` for good); then it decays by β₂ a step as in
    fp32, to the size of the other entries."""
    bf16_max = torch.finfo(torch.bfloat16).max
    spiked, end = _muon2_spike_run(torch.bfloat16, 200)  # 0.5**200 · 3.4e38 ≈ 2e-22
    assert torch.isfinite(spiked).all() and spiked[1, 2].item() == bf16_max
    ref_spiked, ref_end = _muon2_spike_run(torch.float32, 200)
    assert ref_spiked[1, 2].item() == F32_MAX
    others = torch.ones(4, 6, dtype=torch.bool)
    others[1, 2] = False
    for V in (end, ref_end):  # the same shape of behaviour in both dtypes
        assert torch.isfinite(V).all()
        assert V[1, 2] <= 10 * V[others].max(), V[1, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("transform", "key", "hp"),
    [
        (AdamPrecondition(), "grad_second_moment", {"beta2": 0.0, "muon2_eps": 1e-16}),
        (ElementwiseNormalize(), "second_moment", {"beta2": 0.0, "eps": 1e-8}),
        (RowNormalize(), "row_second_moment", {"beta2": 0.0, "eps": 1e-8}),
    ],
    ids=["muon2", "adamuon", "normuon"],
)
def test_a_narrow_second_moment_is_stored_saturated_not_infinite(dtype, transform, key, hp):
    """An entry whose square is past the *storage* dtype's range (1e30 in bf16; 600 in
    fp16: 3.6e5, a row mean of 9e4 > 65504) is stored as that dtype's max; the other
    entries are the fp32 EMA rounded once, as before."""
    big = 1e30 if dtype == torch.bfloat16 else 600.0
    X = torch.full((1, 2, 4), 0.5)
    X[0, 0, 1] = big
    X = X.to(dtype)
    shape = (1, 2) if key == "row_second_moment" else (1, 2, 4)
    state = {key: torch.zeros(shape, dtype=dtype)}
    out = transform(X, state, StepContext(grad=X, hp=hp))
    V = state[key]
    assert V.dtype == dtype and torch.isfinite(V).all(), V
    assert V.flatten()[0 if key == "row_second_moment" else 1].item() == torch.finfo(dtype).max
    # β₂ = 0: V = X² (row means for NorMuon) wherever that is in range
    squares = X.float().square()
    expect = squares.mean(-1) if key == "row_second_moment" else squares
    assert torch.equal(V[0, 1], expect[0, 1].to(dtype))  # the row without the spike
    assert not torch.isnan(out).any()


def test_an_fp32_second_moment_is_the_plain_ema_bit_for_bit():
    """No finite value moves: Muon²'s fp32 ``V`` is ``β₂V + (1−β₂)G²`` exactly."""
    g = torch.Generator().manual_seed(3)
    G = torch.randn(2, 5, 7, generator=g)
    V0 = torch.rand(2, 5, 7, generator=g)
    state = {"grad_second_moment": V0.clone()}
    AdamPrecondition()(G, state, StepContext(grad=G, hp={"beta2": 0.95, "muon2_eps": 1e-16}))
    assert torch.equal(state["grad_second_moment"], V0.mul(0.95).addcmul(G, G, value=0.05))


def _adamw_pair(foreach: bool, monkeypatch: pytest.MonkeyPatch):
    """Three fp32 parameters, ours (the adamw rule) and torch.optim.AdamW's, and a stepper."""
    import dmuon.optim.scalar as scalar

    if not foreach:  # torch's per-parameter loop (taken for DTensors, mixed devices)
        monkeypatch.setattr(scalar, "_foreach", lambda params, grads: False)
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=g) for s in ((5,), (3, 2), (1,))]
    theirs = [torch.nn.Parameter(p.clone()) for p in ours]
    states = [{k: torch.zeros(s) for k, s in scalar_state_shapes("adamw", p).items()} for p in ours]
    group = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    reference = torch.optim.AdamW(theirs, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step(grads: list[torch.Tensor]) -> None:
        get_scalar_rule("adamw").update(ours, grads, states, group)
        for p, grad in zip(theirs, grads, strict=True):
            p.grad = grad.clone()
        reference.step()

    return ours, theirs, states, reference, step, g


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
def test_an_adamw_gradient_spike_saturates_and_everything_else_is_torchs_bits(foreach, monkeypatch):
    """One gradient entry of 1e20: torch's ``exp_avg_sq`` is ``inf`` there for good (and
    that entry never moves again); ours is fp32's max, and decays. Every other entry of
    every parameter and buffer is torch's, bit for bit."""
    ours, theirs, states, reference, step, g = _adamw_pair(foreach, monkeypatch)
    grads = [torch.randn(p.shape, generator=g) for p in ours]
    grads[0][2] = 1e20
    step(grads)
    v, v_ref = states[0]["exp_avg_sq"], reference.state[theirs[0]]["exp_avg_sq"]
    assert v[2].item() == F32_MAX and v_ref[2].item() == float("inf")
    for k in range(30):
        step([torch.randn(p.shape, generator=g) for p in ours])
        if k == 0:
            assert torch.isfinite(v).all() and v[2].item() < F32_MAX  # decaying by β₂
    mask = torch.ones(5, dtype=torch.bool)
    mask[2] = False
    assert torch.equal(ours[0][mask], theirs[0].detach()[mask])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(states[0][key][mask], reference.state[theirs[0]][key][mask]), key
    for p, q, s in zip(ours[1:], theirs[1:], states[1:], strict=True):
        assert torch.equal(p, q.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key], reference.state[q][key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adamw_spike_leaves_finite_state_in_dmuon(dtype):
    """End to end (the reviewer's case): a bias takes one gradient entry of 1e20, then
    ordinary ones (fp16 cannot hold such a gradient, and its fp32 state holds the square
    of any fp16 one). Its state (fp32 for a bf16 parameter) is finite, the spiked
    entry's ``exp_avg_sq`` decays back among the others' (it stayed ``inf`` for good),
    and the entry moves again."""
    b = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    opt = DMuon([{"params": [b], "rule": "adamw"}], lr=0.02, adamw_betas=(0.5, 0.8))
    grad = torch.ones(4)
    grad[0] = 1e20
    b.grad = grad.to(dtype)
    opt.step()
    for _ in range(500):  # 0.8**500 · 3.4e38 ≈ 1e-10
        before = b.detach().float().clone()
        b.grad = torch.ones(4, dtype=dtype)
        opt.step()
    v = opt.state[b]["exp_avg_sq"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.isfinite(opt.state[b][key]).all(), (key, opt.state[b][key])
    assert v[0] <= 2 * v[1:].max(), v
    if dtype == torch.float32:  # a bf16 weight of ~10 does not resolve lr = 0.02
        moved = (b.detach() - before).abs()
        assert moved[0] > 0.5 * moved[1:].mean(), moved


def test_narrow_scalar_buffers_are_written_back_saturated_at_their_own_max():
    """Buffers a loader left in bf16 are widened, stepped and written back: fp32's max
    rounded to ``inf`` there, so they are clamped to bf16's max first."""
    p = torch.zeros(3, dtype=torch.bfloat16)
    grad = torch.tensor([1e20, 1.0, -1.0], dtype=torch.bfloat16)
    m, v = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)
    step = torch.zeros(())
    adamw_step([p], [grad], [m], [v], [step], lr=0.01, betas=(0.9, 0.95), eps=1e-8,
               weight_decay=0.0)  # fmt: skip
    assert v.dtype == torch.bfloat16 and v[0].item() == torch.finfo(torch.bfloat16).max
    assert torch.isfinite(m).all() and torch.isfinite(p).all()


def _fsdp2_spike(rank: int, world: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8)
    fully_shard(norm, mesh=init_device_mesh("cpu", (world,)))
    opt = DMuon([{"params": list(norm.parameters()), "rule": "adamw"}], lr=0.02)
    seen = []
    for t in range(3):
        for p in norm.parameters():
            grad = torch.ones(8)
            grad[5] = 1e20 if t == 0 else 1.0
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        opt.step()
        v = opt.state[norm.weight]["exp_avg_sq"]
        assert hasattr(v, "placements")  # FSDP2's state is a DTensor: clamped by its shard
        seen.append(v.full_tensor()[5].item())
    return seen


def test_an_fsdp2_adamw_state_saturates_through_its_local_shard():
    from dmuon.comm.testing import run_on_ranks

    for seen in run_on_ranks(_fsdp2_spike, 2, timeout=90):
        assert seen[0] == F32_MAX and F32_MAX > seen[1] > seen[2] > 0, seen  # decaying by β₂
