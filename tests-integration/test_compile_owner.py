"""Owner mode under ``torch.compile`` beyond the whole compiled model: a compiled
submodule reads current weights, and ``fullgraph=True`` says why it cannot be.

ZeRO-2-like owner mode (``ddp.dedicate``) puts a forward pre-hook on each module holding
a dedicated weight (``blocks[1].up``), so that the submodule called directly right after
``opt.step()`` waits for its layer's broadcast. That hook used to return whenever
``torch.compiler.is_compiling()``, on the assumption that the whole model was compiled
(its layers' hooks wait): ``torch.compile(model.blocks[1].up)`` called right after the
step read the previous step's weights on the rank that does not own them. The owner's
step is slowed (its matrices' rule sleeps) so that its broadcast has surely not landed
when the other rank calls the probe: without the wait the probe is stale every step.

The reference is the eager ``F.linear`` of the same weights after ``ded.wait()`` (every
broadcast landed), so the difference must be exactly 0. Backend ``aot_eager``, as
test_compile.py (which checks that the whole compiled model's counts do not move).
"""

from __future__ import annotations

import time

import pytest
import torch.nn.functional as F

from benchmarks.compile_check import OPT, Net
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

STEPS = 8
PROBED = "blocks.1.up.weight"


def probe_after_step(rank: int, world: int, compiled: bool) -> list[float]:
    import torch._dynamo

    from dmuon.integrations import ddp

    torch._dynamo.reset()
    net = Net(16, inputs=16, outputs=8)
    ded = ddp.dedicate(net, layer_pack_mb=0)
    opt = DMuon(param_groups(net), distributed=ded, **OPT)
    if ded.exchange.plan.owner(PROBED) == rank:  # the owner broadcasts late
        step_matrices = opt.step_matrices

        def slow(*args, **kwargs):
            time.sleep(0.3)
            return step_matrices(*args, **kwargs)

        opt.step_matrices = slow  # type: ignore[method-assign]
    up = net.blocks[1].up
    probe = torch.compile(up, backend="aot_eager") if compiled else up
    h = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    diffs = []
    for t in range(STEPS):
        g = torch.Generator().manual_seed(t + 10 * rank)
        F.mse_loss(net(torch.randn(4, 16, generator=g)), torch.randn(4, 8, generator=g)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            got = probe(h)  # right after the step: the broadcast may be in flight
        ded.wait()
        with torch.no_grad():
            want = F.linear(h, up.weight, up.bias)
        diffs.append(float((got - want).abs().max()))
    return diffs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_submodule_called_after_step_reads_current_weights(compiled):
    results = run_on_ranks(probe_after_step, 2, args=(compiled,), timeout=240)
    for rank, diffs in enumerate(results):
        assert diffs == [0.0] * STEPS, f"rank {rank}: probe differs from current weights {diffs}"


def fullgraph_error(rank: int, world: int) -> str:
    import torch._dynamo

    from dmuon.integrations import ddp

    torch._dynamo.reset()
    net = Net(16, inputs=16, outputs=8)
    ded = ddp.dedicate(net)
    DMuon(param_groups(net), distributed=ded, **OPT)
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    try:
        compiled(torch.randn(4, 16))
    except Exception as err:  # dynamo's Unsupported
        return str(err)
    return "no error"


def test_fullgraph_error_names_dmuons_hook():
    """``fullgraph=True`` cannot include the owner-mode hooks (they wait on collectives):
    dynamo's error carries DMuon's reason, not only torch's "Remove the
    torch.compiler.disable call"."""
    for rank, message in enumerate(run_on_ranks(fullgraph_error, 2, timeout=120)):
        assert "DMuon's owner-mode hook waits for the owners' broadcast" in message, (
            f"rank {rank}: {message[:600]}"
        )
        assert "fullgraph=True) is not supported in owner mode" in message, message[:600]
