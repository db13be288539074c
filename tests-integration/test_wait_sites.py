"""Every place DMuon waits for other ranks, walked from the source: each is under the deadline.

A rank that stops answering must make the others raise a
:class:`~dmuon.comm.CollectiveError` naming it at DMuon's deadline, not hang for the
process group's half hour. That holds when every wait goes through
:func:`dmuon.comm.wait_work`, which waits under the current
:func:`~dmuon.comm.collective_timeout` — directly, or through a
:class:`~dmuon.comm.CommHandle`, whose ``wait`` calls it. This test reads every
module of the four packages with :mod:`ast` and finds every wait site:

* every call of a ``torch.distributed`` collective (``dist.all_reduce``, …, and the
  ``torch_compat`` wrappers ``all_gather_single`` / ``reduce_scatter_single``);
* every ``.wait(...)`` call.

An asynchronous collective (``async_op=True``) counts as timed when the function it
is issued in (the outermost ``def``) hands its work to ``wait_work`` or to a
``CommHandle``. A ``.wait()`` must be on a ``CommHandle`` or a ``Dedication`` (listed
in :data:`HANDLE_WAITS`, with the reason), or be ``wait_work``'s own. A blocking
collective is allowed only where :data:`UNTIMED` says why it is not one of DMuon's
waits. The sets must match exactly: a new wait site fails this test until it is
timed or listed with its reason, and a listed site that disappears fails it too.
The timed waits themselves are exercised on real ranks by ``test_timeouts.py``,
``test_owner_reliability.py`` and ``test_skip_step.py``.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter",
}
WRAPPERS = {"all_gather_single", "reduce_scatter_single"}  # dmuon.comm.torch_compat

# (file under packages/, function) → why its ``.wait()`` is timed
HANDLE_WAITS = {
    ("dmuon-comm/src/dmuon/comm/faults.py", "wait_work"): "wait_work itself",
    ("dmuon-comm/src/dmuon/comm/faults.py", "_stream_wait"): (
        "wait_work's stream wait (NCCL: returns at once); settle() checks the deadline"
    ),
    ("dmuon-comm/src/dmuon/comm/faults.py", "_raise_if_failed"): (
        "settle(): the wait of a work is_completed() reported done (returns at once)"
    ),
    ("dmuon-comm/src/dmuon/comm/testing.py", "_collect"): (
        "the test harness waits for its rank processes, bounded by run_on_ranks' timeout"
    ),
    ("dmuon-integrations/src/dmuon/integrations/lightning.py", "DMuonStrategy"): (
        "Dedication.wait: the owners' broadcasts, CommHandles"
    ),
    ("dmuon-optim/src/dmuon/optim/engine/planned.py", "Pipeline"): "a CommHandle",
    ("dmuon-optim/src/dmuon/optim/engine/publication.py", "Publication"): (
        "layer.publish_handle: a CommHandle"
    ),
    ("dmuon-optim/src/dmuon/optim/engine/reduction.py", "Reduction"): (
        "layer.reduce_handle: a CommHandle"
    ),
    ("dmuon-optim/src/dmuon/optim/engine/sharded.py", "ShardedEngine"): (
        "the all-to-all's CommHandle"
    ),
}
# (file under packages/, function) → where an asynchronous work it returns is waited
RETURNED = {
    ("dmuon-comm/src/dmuon/comm/shard_all_to_all.py", "_all_to_all"): (
        "returned to shard_all_to_all / shard_all_to_all_reverse, which wrap it in a CommHandle"
    ),
}
# (file under packages/, function, collective) → why it is not one of DMuon's deadline waits
UNTIMED = {
    ("dmuon-comm/src/dmuon/comm/testing.py", "_rank_main", "barrier"): (
        "the test harness's rank start and end, bounded by run_on_ranks' timeout"
    ),
    ("dmuon-comm/src/dmuon/comm/torch_compat.py", "all_gather_single", "all_gather_into_tensor"): (
        "the wrapper itself: its callers pass async_op=True (checked as wrapper calls)"
    ),
    (
        "dmuon-comm/src/dmuon/comm/torch_compat.py",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
    ): ("the wrapper itself: its callers pass async_op=True (checked as wrapper calls)"),
    ("dmuon-optim/src/dmuon/optim/planner/calibrate.py", "_link_rank", "barrier"): (
        "dmuon-plan --calibrate's timing of the links, a tool run of its own"
    ),
    ("dmuon-optim/src/dmuon/optim/planner/calibrate.py", "_link_rank", "all_reduce"): (
        "dmuon-plan --calibrate's timing of the links, a tool run of its own"
    ),
    ("dmuon-optim/src/dmuon/optim/planner/calibrate.py", "_link_rank", "all_gather_single"): (
        "dmuon-plan --calibrate's timing of the links, a tool run of its own"
    ),
    ("dmuon-optim/src/dmuon/optim/planner/calibrate.py", "_link_rank", "reduce_scatter_single"): (
        "dmuon-plan --calibrate's timing of the links, a tool run of its own"
    ),
}


def _async(call: ast.Call) -> bool:
    fn = call.func
    if isinstance(fn, ast.Attribute) and fn.attr in ("isend", "irecv"):
        return True  # always asynchronous: they return their work
    return any(
        k.arg == "async_op" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def wait_sites() -> tuple[set, set, set, list]:
    """``(handle waits, blocking collectives, timed async ones, async ones not handed on)``."""
    waits, blocking, timed, loose = set(), set(), set(), []
    for path in sorted((ROOT / "packages").glob("*/src/dmuon/**/*.py")):
        rel = str(path.relative_to(ROOT / "packages"))
        tree = ast.parse(path.read_text())
        for top in tree.body:
            if not isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            source = ast.unparse(top)
            handed_on = "wait_work(" in source or "CommHandle(" in source
            for node in ast.walk(top):
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                base = ast.unparse(fn.value) if isinstance(fn, ast.Attribute) else None
                if name == "wait" and isinstance(fn, ast.Attribute):
                    waits.add((rel, top.name))
                    continue
                is_dist = name in COLLECTIVES and base in ("dist", "torch.distributed")
                if not (is_dist or (name in WRAPPERS and base is None)):
                    continue
                if not _async(node):
                    blocking.add((rel, top.name, name))
                elif handed_on:
                    timed.add((rel, top.name, name))
                else:
                    loose.append((rel, top.name, name, node.lineno))
    return waits, blocking, timed, loose


def test_every_wait_site_is_timed_or_listed_with_its_reason():
    waits, blocking, timed, loose = wait_sites()
    returned = {(f, fn) for f, fn, _, _ in loose}
    assert returned == set(RETURNED), (
        f"asynchronous collectives whose work reaches no wait_work/CommHandle: {loose}"
    )
    for f, _ in RETURNED:  # and the module does wrap what they return
        assert "CommHandle(" in (ROOT / "packages" / f).read_text(), f
    assert waits == set(HANDLE_WAITS), (
        f".wait() sites not listed: {sorted(waits - set(HANDLE_WAITS))}; "
        f"listed but gone: {sorted(set(HANDLE_WAITS) - waits)}"
    )
    unlisted, gone = sorted(blocking - set(UNTIMED)), sorted(set(UNTIMED) - blocking)
    assert not unlisted and not gone, (
        f"blocking collectives outside DMuon's deadline, not listed: {unlisted} (issue them "
        f"with async_op=True and wait_work); listed but gone: {gone}"
    )
    # the walk finds what it should: the step's own collectives are among the timed ones
    names = {(f.rsplit("/", 1)[-1], fn) for f, fn, _ in timed}
    for expected in [
        ("guards.py", "agree_step"),
        ("tensor_split.py", "_matrix_split"),
        ("owned_split.py", "split_to_save"),
        # the padded all-gather of chunks: tensor-parallel gathers, a split matrix's
        # state to its owner (owned_split.split_to_owner), checkpoints' DTensors made whole
        ("chunk_gather.py", "all_gather_chunks"),
        ("owner_collectives.py", "reduce_to_owners"),
        ("plan_agreement.py", "check_plan_consistency"),
        ("objects.py", "all_gather_objects"),
        ("full.py", "_gather_owned"),  # checkpoints: checkpoint/deadline.py
        ("sharded_state.py", "_gathered_state"),
        ("sharded_state.py", "owner_steps"),
        ("state.py", "gather_full_state_dict"),
    ]:
        assert expected in names, f"{expected} not found among the timed collectives: {names}"


def test_a_comm_handle_waits_through_wait_work():
    tree = ast.parse((ROOT / "packages/dmuon-comm/src/dmuon/comm/handles.py").read_text())
    handle = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CommHandle")
    wait = next(n for n in handle.body if isinstance(n, ast.FunctionDef) and n.name == "wait")
    calls = {ast.unparse(c.func) for c in ast.walk(wait) if isinstance(c, ast.Call)}
    assert "wait_work" in calls, calls
