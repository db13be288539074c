"""Batching: a bucket's same-shape matrices stepped by one rule call per stacked batch.

A step runs the rule once per bucket (:mod:`dmuon.optim.batch_layout`) on the stacked
batch — one ``torch.cat`` of the gradients, one batched Newton–Schulz call, two
``torch._foreach_*`` calls to apply — never a per-parameter loop of kernels. A bucket
whose state is stacked updates its buffers in place; one whose parameters are cut into
blocks of different shapes gathers the blocks' state before the rule and scatters it
back after. (A ``transposed`` weight's gradient is still copied into the batch and its
update into the weight's columns: the rule needs ``(m, n)`` matrices.) Both paths give
the same numbers. When some parameters of a bucket have no gradient, only the others
are gathered — state of the rest is not touched. A bucket larger than a call may hold
is cut as :mod:`dmuon.optim.batch_cuts` says.

The buckets (:class:`Entry`, :class:`Bucket`, :func:`build_buckets`,
:func:`state_shapes`) and the cut (:func:`batch_runs`, :func:`default_batch_elements`)
stay importable from here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dmuon.optim.apply import apply_update
from dmuon.optim.batch_cuts import batch_runs, default_batch_elements
from dmuon.optim.batch_layout import Bucket, Entry, build_buckets, state_shapes
from dmuon.optim.matrix_split import local_tensor
from dmuon.optim.rules import Rule
from dmuon.optim.sparse_gradients import first_sparse, sparse_gradient_error
from dmuon.optim.state_precision import (
    compute_dtype_for,
    round_state_,
    rounding_seed,
    state_dtype_of,
)
from dmuon.optim.transforms import StateSpec
from dmuon.optim.vote import SignVote, local_vote

__all__ = [
    "Bucket",
    "Entry",
    "batch_runs",
    "build_buckets",
    "default_batch_elements",
    "state_shapes",
    "step_bucket",
]

# sink(entry, update, scale): where an engine takes an entry's update instead of
# applying it (see step_bucket).
Sink = Callable[["Entry", torch.Tensor, float], None]


def _state_block(b: Bucket, e: Entry, spec: StateSpec, st: Mapping[str, torch.Tensor]):
    """A writable view of entry ``e``'s slice of state ``spec``."""
    if b.buffers is not None:
        return b.buffers[spec.name][e.start : e.start + e.count]
    t = st[spec.name]
    if e.layout.whole:
        return t
    if spec.kind == "matrix":
        return e.layout.block_view(t, e.block)
    return e.layout.row_block_view(t, e.block)


def _chunks(part: list[Entry], per_entry: int, limit: int) -> list[list[Entry]]:
    """Consecutive runs of ``part`` holding at most ``limit`` entries (at least one each)."""
    return [
        [part[i] for i in run] for run in batch_runs([e.count * per_entry for e in part], limit)
    ]


def active_entries(b: Bucket, grads: Mapping[torch.Tensor, torch.Tensor] | None) -> list[Entry]:
    """The entries of ``b`` that have a gradient (``param.grad``, or a key of ``grads``)."""
    if grads is None:
        return [e for e in b.entries if e.param.grad is not None]
    return [e for e in b.entries if e.param in grads]


def _refuse_sparse(
    active: list[Entry], grads: Mapping[torch.Tensor, torch.Tensor] | None, group: Mapping[str, Any]
) -> None:
    """Raise, naming the parameter, if an entry of ``active`` has a sparse gradient."""
    i = first_sparse(e.param.grad if grads is None else grads[e.param] for e in active)
    if i is not None:
        e = active[i]
        names = group.get("param_names")
        name = names[e.index] if names is not None and e.index < len(names) else e.index
        raise sparse_gradient_error(f"parameter {name!r} (shape {tuple(e.param.shape)})")


@torch.no_grad()
def step_bucket(
    b: Bucket,
    group: Mapping[str, Any],
    rule: Rule,
    state: Mapping[torch.Tensor, Mapping[str, torch.Tensor]],
    vote: SignVote = local_vote,
    max_batch_elements: int | None = None,
    *,
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    sink: Sink | None = None,
    timings: dict[str, float] | None = None,
    active: list[Entry] | None = None,
) -> int:
    """Run ``rule`` on the entries of ``b`` that have a gradient and apply the update.

    Entries whose parameter has no gradient are skipped: neither their weights nor
    their state change. With a rule that reads the step count, entries at different
    counts run as separate batches. A batch holds at most ``max_batch_elements``
    matrix entries (default :func:`default_batch_elements`); every transform acts
    on each matrix independently, so how a bucket is cut changes no number.

    The distributed engine uses three hooks: ``grads`` maps a parameter to the
    gradient to use instead of ``param.grad`` (a parameter missing from it is
    skipped), e.g. the whole matrix an owner gathered from the shards of a
    sharded parameter; ``sink(entry, update, scale)`` receives each entry's
    update, ``(count, m, n)``, instead of having it applied (the caller applies
    ``W ← W·(1 − lr·wd) − lr·scale·update`` where the weight lives); ``timings``
    accumulates the seconds spent in the rule (``"rule"``) and in applying
    (``"apply"``). ``active``: the entries of ``b`` that have a gradient (``p.grad``, or
    in ``grads``), in bucket order, when the caller has listed them already
    (:func:`~dmuon.optim.stepping.step_matrices`); ``None``: listed here.

    Returns:
        The number of matrices the rule ran on.

    Raises:
        RuntimeError: an entry's gradient is sparse (named), when ``active`` is
            ``None``; with ``active`` given, the caller has checked (``DMuon.step``
            does, before any engine steps).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, build_buckets, get_rule, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
        ...                             torch.nn.Linear(32, 16))
        >>> group = DMuon(param_groups(model)).param_groups[0]  # the matrix group
        >>> buckets, state = build_buckets(group, get_rule("muon"), lambda p: {}, str)
        >>> model[0](torch.randn(4, 32)).sum().backward()  # a gradient for layer 0 only
        >>> step_bucket(buckets[0], group, get_rule("muon"), state)  # layer 1 is skipped
        1
        >>> [bool(state[m.weight]["momentum_buffer"].any()) for m in model[:2]]
        [True, False]
    """
    if active is None:  # called on its own (DMuon.step refused a sparse gradient before)
        active = active_entries(b, grads)
        _refuse_sparse(active, grads, group)
    if not active:
        return 0
    if rule.uses_step:
        parts: dict[int, list[Entry]] = {}
        for e in active:
            parts.setdefault(int(state[e.param]["step"].item()), []).append(e)
        batches = list(parts.items())
    else:
        batches = [(int(state[active[0].param]["step"].item()), active)]
    limit = default_batch_elements(b.device) if max_batch_elements is None else max_batch_elements
    ran = 0
    for step, part in batches:
        for chunk in _chunks(part, b.elements, limit):
            _run_batch(b, chunk, group, rule, state, step, vote, grads, sink, timings)
            ran += sum(e.count for e in chunk)
    return ran


def _run_batch(
    b: Bucket,
    part: list[Entry],
    group: Mapping[str, Any],
    rule: Rule,
    state: Mapping[torch.Tensor, Mapping[str, torch.Tensor]],
    step: int,
    vote: SignVote,
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    sink: Sink | None = None,
    timings: dict[str, float] | None = None,
) -> None:
    t0 = time.perf_counter()
    specs = rule.state_specs()
    m, n = b.shape
    source = [e.param.grad if grads is None else grads[e.param] for e in part]
    # the rule sees this rank's shards (matrix_split.py) or its local experts
    source = [
        local_tensor(g) if e.local else g  # type: ignore[arg-type]
        for e, g in zip(part, source, strict=True)
    ]
    if b.gathered:  # the whole matrices from every rank's shards (see Bucket.gathered)
        assert b.split is not None and b.split.gather is not None
        shards = torch.stack([g.reshape(g.shape[-2], g.shape[-1]) for g in source])  # type: ignore[union-attr]
        G = b.split.gather(shards)
    elif len(part) > 1 and all(
        e.plain and g.shape == b.shape  # type: ignore[union-attr]
        for e, g in zip(part, source, strict=True)
    ):  # whole (m, n) matrices: stacked, one copy (what cat of their (1, m, n) views gives)
        G = torch.stack(source)  # type: ignore[arg-type]
    else:
        batch = [e.batch(g) for e, g in zip(part, source, strict=True)]  # type: ignore[arg-type]
        G = batch[0] if len(batch) == 1 else torch.cat(batch)
    consecutive = all(nxt.start == cur.start + cur.count for cur, nxt in itertools.pairwise(part))
    views: dict[str, list[torch.Tensor]] = {}
    if b.buffers is not None and consecutive:
        # the entries' state is one contiguous slice of the stacked buffers
        lo, hi = part[0].start, part[-1].start + part[-1].count
        st = {name: buf[lo:hi] for name, buf in b.buffers.items()}
    else:
        views = {s.name: [_state_block(b, e, s, state[e.param]) for e in part] for s in specs}
        st = {
            s.name: torch.cat(
                [
                    v.reshape((e.count, m, n) if s.kind == "matrix" else (e.count, m))
                    for v, e in zip(views[s.name], part, strict=True)
                ]
            )
            for s in specs
        }
    split = None if b.gathered else b.split
    # state_dtype None, or the parameters' own dtype and already wide: st updated in place
    if group.get("state_dtype") is None or (
        compute_dtype_for(b.dtype) == b.dtype == state_dtype_of(group, b.dtype)
    ):
        U, scale = rule.update(G, st, group, step=step, vote=vote, split=split)
    else:  # low-precision state: upcast on read, math wide, round on write
        wide_dtype = compute_dtype_for(b.dtype)
        wide = {k: v.to(wide_dtype) for k, v in st.items()}
        U, scale = rule.update(G.to(wide_dtype), wide, group, step=step, vote=vote, split=split)
        U = U.to(b.dtype)
        rounding = group.get("state_rounding") or "nearest"
        # by step, parameter name and block: the same bits on every rank, in every mode,
        # batch cut and listing order (the name, not e.index: ranks may list a group's
        # parameters in different orders; positions only where the group has no names)
        names = group.get("param_names")
        if names is not None and len(names) != len(group["params"]):
            names = None
        seeds = [
            (
                rounding_seed(
                    step,
                    e.index if names is None else names[e.index],
                    e.block.row_start,
                    b.shape,
                    e.offset,
                ),
                e.count,
            )
            for e in part
        ]
        for k, v in st.items():
            round_state_(v, wide[k], rounding, seeds)
    if b.gathered:  # this rank's shard of every whole update
        assert b.split is not None
        d = b.split.dim
        U = U.narrow(d, b.split.offset, source[0].shape[d])  # type: ignore[union-attr]
    counts = [e.count for e in part]
    for s in specs if views else ():
        chunks = st[s.name].split(counts)
        torch._foreach_copy_(
            views[s.name],
            [c.reshape(v.shape) for c, v in zip(chunks, views[s.name], strict=True)],
        )
    t1 = time.perf_counter()
    if sink is not None:
        for e, u in zip(part, U.split(counts), strict=True):
            sink(e, u, scale)
    else:
        weights = [local_tensor(e.param) if e.local else e.param for e in part]
        targets = [e.tensor_block(w) for e, w in zip(part, weights, strict=True)]
        if all(e.plain and t.shape == U.shape[1:] for e, t in zip(part, targets, strict=True)):
            updates = list(U.unbind(0))  # each entry one matrix of the batch, in its shape
        else:
            updates = [c.reshape(t.shape) for c, t in zip(U.split(counts), targets, strict=True)]
        apply_update(
            targets,
            updates,
            lr=float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            scale=scale,
            cautious=bool(group.get("cautious_weight_decay", False)),
        )
    if timings is not None:
        t2 = time.perf_counter()
        timings["rule"] = timings.get("rule", 0.0) + (t1 - t0)
        timings["apply"] = timings.get("apply", 0.0) + (t2 - t1)
