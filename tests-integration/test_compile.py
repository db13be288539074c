"""``torch.compile(model)`` after DMuon's ``dedicate`` trains as eager, without recompiles.

A tiny residual MLP trains 5 steps at 2 gloo ranks with its forward compiled by
``torch.compile`` in each way DMuon meets a model: owner mode after
``ddp.dedicate`` and after ``fsdp.dedicate`` (+ ``fully_shard`` for the rest), each
also ZeRO-3-like (``reshard_after_forward=True``), replicated mode under a compiled
stock DDP (the module inside DDP compiled: ``model.compile()``) and sharded mode
under compiled stock FSDP2. The reference is the same
model trained eagerly in one process on the same global batch (tolerance 1e-5 as
in test_modes_equal_single.py: fp32 Newton–Schulz, only the order of the gradient
sums differs).

Dynamo's counters (``torch._dynamo.utils.counters``) are read after every step:
graph breaks, frames compiled (a recompile compiles a frame again) and graphs must
not grow after the first step. The only graph breaks allowed are DMuon's layer
hooks, which are ``torch.compiler.disable``-d on purpose (they wait on collectives;
see hooks.py and the guide "torch.compile").

Backend ``aot_eager``: dynamo and AOTAutograd (where breaks, guards and the hooks'
interplay live) without inductor's C++ code generation, which took 43 s for one
tiny MLP on the 2-core CI machine — over this file's budget by itself. Set
``DMUON_COMPILE_BACKEND=inductor`` to run the same check with inductor (minutes on
a CPU).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from distributed_cases import full_params, mean_loss_reference

from benchmarks.compile_check import HOOK_BREAK, MODES, OPT, Net, counts, setup
from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, param_groups

STEPS = 5
GLOBAL_BATCH = 8
TOLERANCE = 1e-5
BACKEND = os.environ.get("DMUON_COMPILE_BACKEND", "aot_eager")


def tiny() -> Net:
    """The model and setups are ``benchmarks/compile_check.py``'s (its GPU counterpart)."""
    return Net(16, inputs=8, outputs=4)


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def reference(world: int) -> dict[str, torch.Tensor]:
    """Eager, one process, the mean of the ranks' losses each step."""
    model = tiny()
    return mean_loss_reference(model, DMuon(param_groups(model), **OPT), batch, STEPS, world)


def run_compiled(rank: int, world: int) -> dict[str, dict]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    for mode in MODES:
        torch._dynamo.reset()
        counters.clear()
        model, forward, opt, ded = setup(mode, tiny(), "cpu")
        if mode == "replicated":
            # compile the module DDP wraps, in place: compiling the DDP wrapper traces
            # DDP's own forward, which breaks 3 times (its Logger, _inside_ddp_forward)
            # and recompiles at step 2 (DDP rebuilds its buckets after step 1)
            model.compile(backend=BACKEND)
            compiled = forward
        else:
            compiled = torch.compile(forward, backend=BACKEND)
        per_step = []
        for t in range(STEPS):
            x, y = batch(t, rank, world)
            F.mse_loss(compiled(x), y).backward()
            opt.step()
            opt.zero_grad()
            per_step.append(counts())
        if ded is not None:
            ded.wait()
        reasons = sorted(str(r).splitlines()[0] for r in counters["graph_break"])
        out[mode] = {"params": full_params(model), "counts": per_step, "reasons": reasons}
        torch.distributed.barrier()
    return out


def test_compiled_models_train_as_eager_without_recompiles():
    expected = reference(2)
    results = run_on_ranks(run_compiled, 2, timeout=150 if BACKEND == "aot_eager" else 1200)
    for rank, res in enumerate(results):
        for mode in MODES:
            got = res[mode]
            first, last = got["counts"][0], got["counts"][-1]
            assert first["graphs"] >= 1, f"{mode}: nothing was compiled"
            # nothing new after the first step: no break, no recompile, no new graph
            assert last == first, f"{mode}, rank {rank}: counters grew: {got['counts']}"
            for reason in got["reasons"]:
                assert HOOK_BREAK in reason, f"{mode}: unexpected graph break {reason!r}"
            # the guide's table: the owner modes break at DMuon's hook once, the others never
            hooked = mode.startswith("owner")
            assert len(got["reasons"]) == hooked, f"{mode}: graph breaks {got['reasons']}"
            for name, want in expected.items():
                diff = float((got["params"][name] - want).abs().max())
                assert diff <= TOLERANCE, f"{mode}, rank {rank}: {name} differs by {diff:.2e}"
