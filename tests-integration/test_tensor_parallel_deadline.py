"""A rank that never arrives at a tensor-parallel sum makes the others raise within DMuon's
deadline, naming the collective.

The pending sums (``Partial``) of tensor-parallel gradients are carried out over ``tp``
by collectives DMuon issues itself (``dmuon.optim.engine.relayout``), waited under
``DMuon(timeout=...)`` like every other collective of a step. Before, DTensor's
``redistribute`` carried them out, with no deadline: the others waited for the process
group's own timeout (here just below ``run_on_ranks``' 90 s, gloo's 30 minutes by
default) and the error named no collective. Three places, on ``PendingNet`` (a rowwise
weight and a whole matrix, both with ``Partial`` gradients), rank 1 stalling well past
the deadline:

* ``single`` mode (tp 2): rank 1 stalls before ``opt.step()``; rank 0's step opens with
  the reduce-scatter of ``tok.weight``'s pending sum;
* ``clip_grad_norm_`` (``single``, tp 2): rank 1 stalls before clipping; rank 0's
  clipping opens with the same reduce-scatter, under the optimizer's deadline too;
* ``owner`` mode (dp 2 × tp 2): the owner's ``tp`` row carries out ``mix.weight``'s
  pending sum after the reduction over ``dp`` (``OwnerEngine._settle_owned``); the
  ``tp`` rank 1 of that row stalls there, after the step's agreement.
"""

from __future__ import annotations

import time

import pytest
from test_tensor_parallel_pending_sums import PendingNet, batch, loss_of, parallelize

from dmuon.comm import CollectiveError
from dmuon.comm.testing import rank_store, run_on_ranks
from dmuon.optim import DMuon, clip_grad_norm_, param_groups

DMUON_TIMEOUT = 2.0
STALL = 4 * DMUON_TIMEOUT  # the stalled rank sleeps this long: well past the deadline
OPT = dict(lr=0.02, ns_compute_dtype="float32", timeout=DMUON_TIMEOUT)


def run_stalled(rank: int, world: int, where: str) -> dict:
    from tensor_parallel_cases import mode_mesh

    import dmuon.optim.engine.owner as owner_engine
    from dmuon.integrations import ddp

    mode = "owner" if where == "owner" else "single"
    mesh, tp, rows, row = mode_mesh(mode, world)
    model = parallelize(PendingNet(), tp)
    ded = ddp.dedicate(model, mesh) if mode == "owner" else None
    opt = DMuon(param_groups(model), mode=mode, distributed=ded, store=rank_store(), **OPT)
    stalls = tp.get_local_rank() == 1 and (where == "owner" or rank == 1)
    if where == "owner" and stalls:  # only the owner's row carries out mix.weight's sum
        settle = owner_engine.settle_split_grads

        def late(params, *args):
            time.sleep(STALL)
            settle(params, *args)

        owner_engine.settle_split_grads = late  # type: ignore[assignment]
    x, y = batch(0)
    part = slice(len(x) // rows * row, len(x) // rows * (row + 1))
    x, y = x[part], y[part]
    loss_of(model(x.chunk(tp.size())[tp.get_local_rank()]), y).backward()
    if stalls and where != "owner":
        time.sleep(STALL)
    t0 = time.monotonic()
    try:
        if where == "clip":
            clip_grad_norm_(opt, 1.0)
        opt.step()
        if ded is not None:
            ded.wait()
    except CollectiveError as err:
        return {"error": str(err), "reason": err.reason, "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("where", "world", "what"),
    [
        (
            "single",
            2,
            "the reduce-scatter of the pending sum (Partial) of 'tok.weight' over mesh dim 'tp'",
        ),
        (
            "clip",
            2,
            "the reduce-scatter of the pending sum (Partial) of 'tok.weight' over mesh dim 'tp'",
        ),
        (
            "owner",
            4,
            "the all-reduce of the pending sum (Partial) of 'mix.weight' over mesh dim 'tp'",
        ),
    ],
)
def test_a_rank_missing_from_a_tensor_parallel_sum_is_named_at_the_deadline(where, world, what):
    # a hang fails here as RankFailure ("still running at the 90 s timeout")
    values = run_on_ranks(run_stalled, world, args=(where,), timeout=90)
    # named in the rank's own error, not in the roll call's list of where the others wait
    named = [
        v for v in values if v["error"] is not None and what in v["error"].split("oll call")[0]
    ]
    assert named, f"no rank named {what!r}: {values}"
    for v in named:
        assert v["reason"] == "timeout", v["error"]
        assert f"within {DMUON_TIMEOUT:g} s" in v["error"], v["error"]
        assert v["seconds"] < STALL, v  # at the deadline, not when the stalled rank came
