"""Owner mode trains with ``p.grad`` preallocated as views of one flat buffer (apex's and
Megatron's contiguous gradient buffer) like one process, and still refuses a gradient
changed after its layer's launch.

A view shares its base's version counter: with the layers launched one by one
(``layer_pack_mb=0``), every accumulation into a later layer's view moved the counter of
the gradients already taken, and each step raised ``GradientChangedError`` for them.
Now a moved counter of such a view counts only when the gradient's values moved too
(:class:`~dmuon.optim.engine.taken_gradients.TakenGradients`): torch's own in-place
``clip_grad_norm_`` is still refused on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.comm.testing import run_on_ranks

D, STEPS, BATCH = 8, 3, 8
OPT = dict(lr=0.02, adamw_lr=3e-3, ns_compute_dtype=torch.float32)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)
    )


def flat_grads(m: nn.Module) -> None:
    """Each ``p.grad`` a zeroed view of one flat buffer, before backward."""
    params = list(m.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    start = 0
    for p in params:
        p.grad = flat[start : start + p.numel()].view_as(p)
        start += p.numel()


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 4, generator=g)


def train(rank: int, world: int, dedicated: bool) -> dict[str, torch.Tensor]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    m = model()
    ded = ddp.dedicate(m, layer_pack_mb=0) if dedicated else None
    opt = DMuon(param_groups(m), distributed=ded, **OPT)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for t in range(STEPS):
        flat_grads(m)
        x, y = batch(t)
        F.mse_loss(m(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    if ded is not None:
        ded.wait()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_flat_buffer_gradients_train_like_one_process() -> None:
    reference = train(0, 1, False)
    for rank, out in enumerate(run_on_ranks(train, 2, args=(True,), timeout=120)):
        for name, want in reference.items():
            torch.testing.assert_close(
                out[name], want, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}"
            )


def clipped(rank: int, world: int) -> dict[str, object]:
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, GradientChangedError, param_groups

    m = model()
    ded = ddp.dedicate(m, layer_pack_mb=0)
    opt = DMuon(param_groups(m), distributed=ded, **OPT)
    flat_grads(m)
    x, y = batch(rank)
    F.mse_loss(m(x), y).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)  # in place, after the launches
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    out: dict[str, object] = {}
    try:
        opt.step()
    except GradientChangedError as err:
        out.update(ranks=err.ranks, names=err.names)
    ded.wait()
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    return out


def test_torch_clip_of_flat_buffer_gradients_still_refused() -> None:
    for rank, out in enumerate(run_on_ranks(clipped, 2, timeout=120)):
        assert out.get("ranks") == [0, 1], (rank, out)
        # every parameter was scaled by the clip: each one is named
        assert len(out["names"]) == len(list(model().parameters())), (rank, out)
        assert out["unchanged"], f"rank {rank}: a parameter moved in the refused step"
