"""Owner mode refuses a weight written while its publication is in flight.

After ``opt.step()`` each dedicated weight is broadcast from its owner and waited for
only in its layer's forward pre-hook (or ``Dedication.wait()``). A write between the
two (a re-init, an EMA ``copy_to``, ``p.mul_``, ``p.data = ...``) was silently lost on
the ranks that do not own the weight (the broadcast landed over it), so the ranks
trained different models. Now each parameter's version counter and data are noted when
its broadcast is launched and compared when it is waited; the next step's agreement
raises :class:`~dmuon.optim.RankDivergenceError` on every rank, naming the parameter
and the ranks, and updates nothing. The same write after ``ded.wait()`` trains what one
process trains on the global batch with the write applied alike.

Also here: the message of :class:`~dmuon.optim.GradientChangedError` for a
post-accumulate-grad hook of the user's registered after ``dedicate()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed_cases import gelu_mlp
from torch import nn

from dmuon.comm.testing import run_on_ranks

STEPS = 3
WORLD = 2


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def write(m: nn.Module, how: str, step: int, rank: int) -> None:
    """What a training loop might do to a dedicated weight after ``opt.step()``."""
    w = m[0].weight
    with torch.no_grad():
        if how == "mul":  # a manual rescale
            w.mul_(0.9)
        elif how == "copy":  # EMA copy_to: the same values on every rank
            w.copy_(torch.full_like(w, 0.01 * (step + 1)))
        elif how == "reinit":  # a seeded re-init of one layer
            torch.manual_seed(7 + step)
            m[0].reset_parameters()
        elif how == "rank1_copy" and rank == 1:
            w.copy_(torch.zeros_like(w))
    if how == "data":
        w.data = w.data * 0.9


def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(m(x), y)


def run(rank: int, world: int, how: str, wait: bool) -> dict[str, object]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, RankDivergenceError, param_groups

    m = gelu_mlp()
    ded = ddp.dedicate(m)
    opt = DMuon(param_groups(m), distributed=ded, lr=0.02, ns_compute_dtype=torch.float32)
    out: dict[str, object] = {}
    for step in range(STEPS):
        loss(m, *batch(step, rank)).backward()
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        try:
            opt.step()
        except RankDivergenceError as err:
            out.update(ranks=err.ranks, names=err.names, message=str(err), at=step)
            ded.wait()
            out["unchanged"] = all(torch.equal(p, before[n]) for n, p in m.named_parameters())
            out["steps"] = opt.steps_taken
            return out
        opt.zero_grad()
        if wait:
            ded.wait()
        write(m, how, step, rank)
    ded.wait()
    out["params"] = {n: p.detach().clone() for n, p in m.named_parameters()}
    return out


def reference(how: str) -> dict[str, torch.Tensor]:
    """One process, the ranks' batches together (the mean of their losses), the same
    write after each step."""
    from dmuon.optim import DMuon, param_groups

    m = gelu_mlp()
    opt = DMuon(param_groups(m), lr=0.02, ns_compute_dtype=torch.float32)
    for step in range(STEPS):
        total = sum(loss(m, *batch(step, r)) for r in range(WORLD))
        (total / WORLD).backward()
        opt.step()
        opt.zero_grad()
        write(m, how, step, 0)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


REFUSED = ["mul", "copy", "reinit", "data", "rank1_copy"]
WAITED = ["mul", "copy", "reinit", "data"]


def run_all(rank: int, world: int) -> dict[tuple[str, bool], dict[str, object]]:
    """Every case in one launch (a launch costs more than the cases)."""
    cases = [(how, False) for how in REFUSED] + [(how, True) for how in WAITED]
    return {(how, wait): run(rank, world, how, wait) for how, wait in cases}


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[str, bool], dict[str, object]]]:
    return run_on_ranks(run_all, WORLD, timeout=240)


@pytest.mark.parametrize("how", REFUSED)
def test_a_weight_written_before_its_publication_landed_is_refused(how, results):
    wrote = [1] if how == "rank1_copy" else [0, 1]
    for rank, outs in enumerate(results):
        out = outs[(how, False)]
        assert "message" in out, f"rank {rank}: the lost write was not refused ({how})"
        # the write after step 0 is found by step 1's agreement, on every rank alike
        assert out["at"] == 1 and out["steps"] == 1, (rank, out)
        assert out["names"] == ["0.weight"] and out["ranks"] == [wrote], (rank, out)
        message = str(out["message"])
        assert "'0.weight'" in message and f"rank(s) {wrote}" in message, message
        assert "Dedication.wait()" in message and "after opt.step()" in message, message
        assert out["unchanged"], f"rank {rank}: a parameter moved in the refused step"


@pytest.mark.parametrize("how", WAITED)
def test_the_same_write_after_wait_trains_as_one_process(how, results):
    expected = reference(how)
    moved = max((expected[n] - p).abs().max().item() for n, p in gelu_mlp().named_parameters())
    assert moved > 1e-3, "the reference barely trained: the comparison would prove nothing"
    first = results[0][(how, True)]["params"]
    assert isinstance(first, dict)
    for rank, outs in enumerate(results):
        out = outs[(how, True)]
        assert "message" not in out, (rank, out.get("message"))
        params = out["params"]
        assert isinstance(params, dict)
        for n, p in params.items():
            torch.testing.assert_close(p, expected[n], atol=1e-5, rtol=0, msg=f"{rank}: {n}")
            assert torch.equal(p, first[n]), f"rank {rank} and rank 0 differ: {n}"


def post_hook_after_dedicate(rank: int, world: int) -> str:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, GradientChangedError, param_groups

    m = gelu_mlp()
    ded = ddp.dedicate(m)

    def halve(p: torch.Tensor) -> None:  # the user's own hook, after dedicate()'s
        p.grad.mul_(0.5)

    m[0].weight.register_post_accumulate_grad_hook(halve)
    opt = DMuon(param_groups(m), distributed=ded, lr=0.02, ns_compute_dtype=torch.float32)
    loss(m, *batch(0, rank)).backward()
    try:
        opt.step()
    except GradientChangedError as err:
        return str(err)
    return "not refused"


def test_a_gradient_hook_registered_after_dedicate_is_named_in_the_refusal():
    for message in run_on_ranks(post_hook_after_dedicate, WORLD, timeout=120):
        assert "register_post_accumulate_grad_hook" in message, message
        assert "before dedicate()" in message and "p.register_hook" in message, message
