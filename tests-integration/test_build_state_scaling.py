"""Building the optimizer state asks the engine about each parameter once, not once per layer.

In owner and sharded modes the engine has one pipeline group per layer (or layer pack),
and :func:`~dmuon.optim.optimizer_state.build_state` buckets each group's matrices per
pipeline group. It used to let every pipeline group scan every parameter of the group
(``engine.steps(p)`` and ``engine.group_of(p)`` per parameter and pipeline group):
``DMuon(...)`` and ``load_state_dict`` took layers × parameters calls (1001 matrices,
143 layers, owner mode: 144k calls, ~3000 Python lines per matrix, 9.5 s at 4004
matrices). Now the parameters are split by pipeline group in one pass.

Checked on two gloo ranks, in owner mode (``dedicate(layer_pack_mb=0)``: one pipeline
group per layer) and in sharded mode (FSDP2 ``fully_shard`` per block,
``DMuon(layer_pack_mb=0)``: one pipeline group per layer too):

* ``build_state`` calls ``steps``/``group_of`` at most twice per parameter (before:
  ``layers + 1`` times each), and ``load_state_dict`` stays O(parameters);
* the buckets (pipeline groups, entries' names, order, blocks, shapes) and the state
  (keys, shapes, dtypes, placeholders) equal those of the former algorithm, kept here as
  the reference, and so do the state values after one step and after a
  ``load_state_dict`` round trip, against an optimizer built with the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks

LAYERS = 8
WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.q(h) + self.down(torch.tanh(self.up(h)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def reference_build_state(
    state: dict[Any, Any], group: dict[str, Any], index: int, engine: Any
) -> dict[str | None, list[Any]]:
    """The former ``build_state``: every pipeline group scans the whole group through an
    ``include`` filter (O(layers × parameters)); the same buckets and state, by another
    route."""
    from dmuon.optim.batch_layout import build_buckets
    from dmuon.optim.group_options import param_name
    from dmuon.optim.optimizer_state import build_state
    from dmuon.optim.rules import get_rule
    from dmuon.optim.scalar import SCALAR_ALGORITHMS
    from dmuon.optim.state_precision import state_dtype_of

    if group["rule"] in SCALAR_ALGORITHMS:  # that path did not change
        return build_state(state, group, index, engine)
    names = group.get("param_names")
    rule = get_rule(group["rule"])
    out: dict[str | None, list[Any]] = {}
    built: set[int] = set()
    order = (
        sorted(range(len(names)), key=names.__getitem__)
        if names is not None and len(names) == len(group["params"])
        else None
    )
    for pipeline_group in engine.step_groups():

        def include(i: int, p: torch.Tensor, key: str | None = pipeline_group) -> bool:
            return engine.steps(p) and engine.group_of(p) == key

        buckets, new_state = build_buckets(
            group,
            rule,
            lambda p: state.get(p, {}),
            lambda i: param_name(names, i, index, group["params"][i]),
            include=include,
            split_of=engine.split_of,
            on_shard=engine.on_shard,
            order=order,
        )
        out[pipeline_group] = buckets
        for p, st in new_state.items():
            state[p] = st
            built.add(id(p))
    for p in group["params"]:
        if id(p) not in built:
            step = torch.zeros((), dtype=torch.float32)
            old = state.get(p, {}).get("step")
            if isinstance(old, torch.Tensor) and old.numel() == 1:
                step.copy_(old.reshape(()))
            holder = {"step": step}
            for spec in rule.state_specs():
                dtype = state_dtype_of(group, p.dtype, spec)
                holder[spec.name] = torch.zeros(0, dtype=dtype, device=p.device)
            state[p] = holder
    return out


class CountingEngine:
    """The optimizer's engine, counting the calls of ``steps`` and ``group_of``."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls = 0

    def steps(self, p: torch.Tensor) -> bool:
        self.calls += 1
        return bool(self._engine.steps(p))

    def group_of(self, p: torch.Tensor) -> str | None:
        self.calls += 1
        return self._engine.group_of(p)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def describe_buckets(opt: Any, buckets: dict[int, dict[str | None, list[Any]]]) -> list:
    """Pipeline groups, buckets and entries by name, in order."""
    names = {
        id(p): n
        for g in opt.param_groups
        for p, n in zip(g["params"], g["param_names"], strict=True)
    }
    return [
        (
            gi,
            key,
            [
                (
                    b.shape,
                    str(b.dtype),
                    b.size,
                    b.split is None,
                    b.gathered,
                    None
                    if b.buffers is None
                    else {k: tuple(v.shape) for k, v in b.buffers.items()},
                    [
                        (e.index, names[id(e.param)], e.block, e.start, e.local, e.offset)
                        for e in b.entries
                    ],
                )
                for b in bs
            ],
        )
        for gi, per_group in sorted(buckets.items())
        for key, bs in per_group.items()
    ]


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_of(opt: Any) -> list:
    """Every parameter's state, by position: keys, shapes, dtypes, values."""
    return [
        {
            k: (tuple(v.shape), str(v.dtype), plain(v).detach().clone())
            for k, v in opt.state[p].items()
        }
        for g in opt.param_groups
        for p in g["params"]
    ]


def same_state(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys()
        and all(
            x[k][:2] == y[k][:2] and torch.equal(x[k][2], y[k][2])
            for k in x  # placeholders: empty on both sides
        )
        for x, y in zip(a, b, strict=True)
    )


def build(mode: str, world: int, reference: bool) -> tuple[nn.Module, Any, Any]:
    """The model and its optimizer in ``mode``; ``reference``: state built the former way."""
    import dmuon.optim.optimizer as optimizer_module
    from dmuon.optim import DMuon, param_groups

    torch.manual_seed(0)
    model = Stack()
    ded = None
    if mode == "owner":
        from dmuon.integrations import ddp

        ded = ddp.dedicate(model, layer_pack_mb=0)
        kwargs: dict[str, Any] = {"distributed": ded}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        kwargs = {"mode": "sharded", "layer_pack_mb": 0}  # a pipeline group per layer
    saved = optimizer_module.build_state
    if reference:
        optimizer_module.build_state = reference_build_state
    try:
        opt = DMuon(param_groups(model), lr=1e-2, **kwargs)
    finally:
        optimizer_module.build_state = saved
    return model, opt, ded


def train_step(model: nn.Module, opt: Any, ded: Any, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4, WIDTH, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if ded is not None:
        ded.wait()


def run_mode(rank: int, world: int, mode: str) -> dict:
    from dmuon.optim.optimizer_state import build_state

    model, opt, ded = build(mode, world, reference=False)
    ref_model, ref_opt, ref_ded = build(mode, world, reference=True)
    engine = opt._engine
    out: dict[str, Any] = {
        "step_groups": len(engine.step_groups()),
        "params": sum(len(g["params"]) for g in opt.param_groups),
        "stepped": sum(engine.steps(p) for g in opt.param_groups for p in g["params"]),
        "buckets_equal": describe_buckets(opt, opt._buckets)
        == describe_buckets(ref_opt, ref_opt._buckets),
        "built_equal": same_state(state_of(opt), state_of(ref_opt)),
    }
    # the calls build_state makes, per group, on a fresh state
    calls = []
    for gi, group in enumerate(opt.param_groups):
        counting = CountingEngine(engine)
        build_state({}, group, gi, counting)
        calls.append((len(group["params"]), counting.calls))
    out["build_calls"] = calls
    # one step on both: the same state
    train_step(model, opt, ded, rank)
    train_step(ref_model, ref_opt, ref_ded, rank)
    out["stepped_equal"] = same_state(state_of(opt), state_of(ref_opt))
    out["nonzero"] = any(
        v[2].numel() > 0 and bool(v[2].abs().sum() > 0)
        for st in state_of(opt)
        for k, v in st.items()
        if k != "step"
    )
    # a load_state_dict round trip rebuilds the state (build_state again): counted
    sd = opt.state_dict()
    counting = {"calls": 0}
    steps, group_of = engine.steps, engine.group_of

    def counted_steps(p: torch.Tensor) -> bool:
        counting["calls"] += 1
        return steps(p)

    def counted_group_of(p: torch.Tensor) -> str | None:
        counting["calls"] += 1
        return group_of(p)

    engine.steps, engine.group_of = counted_steps, counted_group_of
    try:
        opt.load_state_dict(sd)
    finally:
        del engine.steps, engine.group_of
    out["load_calls"] = counting["calls"]
    out["loaded_buckets_equal"] = describe_buckets(opt, opt._buckets) == describe_buckets(
        ref_opt, ref_opt._buckets
    )
    out["loaded_equal"] = same_state(state_of(opt), state_of(ref_opt))
    train_step(model, opt, ded, rank)
    train_step(ref_model, ref_opt, ref_ded, rank)
    out["second_step_equal"] = same_state(state_of(opt), state_of(ref_opt))
    return out


@pytest.mark.parametrize("mode", ["owner", "sharded"])
def test_build_state_is_linear_and_unchanged(mode: str) -> None:
    results = run_on_ranks(run_mode, 2, args=(mode,), timeout=240)
    for rank, r in enumerate(results):
        assert r["step_groups"] >= LAYERS, (rank, r)  # one pipeline group per layer at least
        assert 0 < r["stepped"] < r["params"] or mode == "sharded", (rank, r)
        for n, calls in r["build_calls"]:
            # steps(p) once per parameter, group_of(p) once per stepped one; the former
            # code: (layers + 1) × n of each
            assert calls <= 2 * n, f"rank {rank}: build_state made {calls} calls for {n} params"
        assert r["load_calls"] <= 4 * r["params"], (
            f"rank {rank}: load_state_dict made {r['load_calls']} steps/group_of calls for "
            f"{r['params']} params ({r['step_groups']} pipeline groups)"
        )
        assert r["buckets_equal"], (rank, "buckets differ from the former algorithm's")
        assert r["built_equal"], (rank, "constructed state differs")
        assert r["nonzero"], (rank, "the step left every state zero: nothing compared")
        assert r["stepped_equal"], (rank, "state after one step differs")
        assert r["loaded_buckets_equal"], (rank, "buckets after load_state_dict differ")
        assert r["loaded_equal"], (rank, "state after load_state_dict differs")
        assert r["second_step_equal"], (rank, "state after a step from the loaded state differs")
