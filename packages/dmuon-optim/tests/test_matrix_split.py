"""Rules on the shards of a split matrix equal the rules on the whole matrix.

The ranks of a tensor-parallel group are simulated by threads, one per shard, whose
``reduce`` sums (or takes the maximum of) their tensors through a barrier: the
chain runs on each shard with a :class:`~dmuon.optim.MatrixSplit`, and the shards'
updates put side by side must equal the unsplit rule's update on the whole matrix
(fp32: to rounding; the Gram iteration on shards is the same polynomial as the
whole-matrix iteration). Uneven and empty shards, both split dimensions, and both
Gram sides (the unsplit side short or long) are covered; the distributed version,
with real DTensors on gloo ranks, is ``tests-integration/test_tensor_parallel.py``.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from dmuon.optim import RULES, MatrixSplit, get_rule

HP = dict(
    momentum=0.9,
    nesterov=True,
    adjust_lr="match_rms_adamw",
    ns_method="gram",
    ns_coefficients="polar_express",
    ns_steps=5,
    ns_compute_dtype="float32",
)


def rule_hp(name: str) -> dict:
    return HP | {k: o.default for k, o in get_rule(name).options.items()}


class ThreadGroup:
    """``reduce`` over ``n`` threads: every thread passes its tensor, all get the result."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * n

    def reduce_for(self, i: int):
        def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            self.slots[i] = t.clone()
            self.barrier.wait()
            stacked = torch.stack([s for s in self.slots if s is not None])
            total = stacked.sum(0) if op == "sum" else stacked.amax(0)
            self.barrier.wait()  # every thread has read the slots
            t.copy_(total)
            return t

        return reduce


def run_split(
    name: str,
    G: torch.Tensor,
    sizes: list[int],
    dim: int,
    steps: int,
    hp: dict | None = None,
    calls: list[int] | None = None,
) -> torch.Tensor:
    """The rule on the shards of each step's ``G[s]`` split into ``sizes`` along ``dim``
    (``hp``: over the rule's defaults; ``calls``: the step of each reduce, appended)."""
    rule = get_rule(name)
    group = ThreadGroup(len(sizes))
    options = rule_hp(name) | (hp or {})
    step_now = [0]
    m, n = G.shape[-2], G.shape[-1]
    out: list[list[torch.Tensor]] = [[] for _ in sizes]
    errors: list[BaseException] = []

    def rank(i: int) -> None:
        try:
            reduce = group.reduce_for(i)

            def counted(t: torch.Tensor, op: str) -> torch.Tensor:
                if calls is not None and i == 0:
                    calls.append(step_now[0])
                return reduce(t, op)

            split = MatrixSplit(dim, (m, n), counted, ("threads", len(sizes)))
            B, mi, ni = G[0].split(sizes, dim=dim)[i].shape
            state = {s.name: torch.zeros(s.batch_shape(B, mi, ni)) for s in rule.state_specs()}
            for s in range(steps):
                if i == 0:
                    step_now[0] = s + 1
                shard = G[s].split(sizes, dim=dim)[i]
                U, scale = rule.update(shard, state, options, step=s + 1, split=split)
                out[i].append(U * scale)
        except BaseException as exc:  # reported below, after every thread stopped
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    shards = range(len(sizes))
    return torch.stack([torch.cat([out[i][s] for i in shards], dim=dim) for s in range(steps)])


def run_whole(name: str, G: torch.Tensor, steps: int) -> torch.Tensor:
    rule = get_rule(name)
    state = {s.name: torch.zeros(s.batch_shape(*G[0].shape)) for s in rule.state_specs()}
    outs = []
    for s in range(steps):
        U, scale = rule.update(G[s], state, rule_hp(name), step=s + 1)
        outs.append(U * scale)
    return torch.stack(outs)


# MuonBP splits by its definition, not by equality with the whole: its blocks are the
# shards (test_muonbp_blocks_are_the_shards below)
SPLITTING = sorted(n for n, r in RULES.items() if r.splits and n != "muonbp")


@pytest.mark.parametrize("name", SPLITTING)
@pytest.mark.parametrize(
    ("shape", "dim", "sizes"),
    [
        ((24, 40), -1, [17, 23]),  # columns, uneven; Gram side 24 is the short one
        ((24, 40), -2, [13, 0, 11]),  # rows, an empty shard; Gram side 40 is the long one
        ((40, 24), -2, [20, 20]),  # rows; Gram side 24 short
        ((40, 24), -1, [5, 7, 12]),  # columns, three ranks; Gram side 40 long
    ],
)
def test_shards_put_together_equal_the_whole(name, shape, dim, sizes):
    g = torch.Generator().manual_seed(sum(shape) + dim)
    steps = 3
    G = torch.randn(steps, 2, *shape, generator=g)  # a batch of two matrices per step
    whole = run_whole(name, G, steps)
    split = run_split(name, G, sizes, dim, steps)
    assert split.shape == whole.shape
    err = (split - whole).abs().max().item() / whole.abs().max().item()
    # fp32 rounding: measured ≤ 9e-6 over these cases, ≤ 4e-5 for AdaMuon (its elementwise
    # division amplifies the rounding of small entries); shards orthogonalised each on
    # its own (no reduce) are off by 0.69
    assert err < 1e-4, f"{name} {shape} split {sizes} along {dim}: relative error {err:.2e}"


def test_every_rule_says_whether_it_splits_and_which_links_need_the_whole():
    assert SPLITTING == ["adamuon", "mona", "muon", "muon2", "normuon", "scion"]
    assert get_rule("muonbp").splits
    for name, rule in RULES.items():
        assert rule.splits == (not rule.unsplittable()), name
    assert get_rule("dion3").unsplittable() == ("ErrorFeedbackSelect",)


@pytest.mark.parametrize(
    ("shape", "dim", "sizes", "blocks"),
    [
        ((24, 40), -1, [20, 20], {"row_blocks": 1, "col_blocks": 2}),
        ((40, 24), -2, [14, 13, 13], {"row_blocks": 3, "col_blocks": 1}),  # tensor_split's cut
    ],
)
def test_muonbp_blocks_are_the_shards(shape, dim, sizes, blocks):
    """On a split matrix MuonBP's blocks are the shards (the paper's layout): its shards put
    together equal the whole matrix stepped with the same blocks, block steps (1 and 3 of
    period 2) and the full step (2) alike; the block steps call no reduce."""
    name = "muonbp"
    g = torch.Generator().manual_seed(sum(shape) + dim)
    steps = 3
    G = torch.randn(steps, 2, *shape, generator=g)
    hp = rule_hp(name) | {"period": 2}
    rule = get_rule(name)
    state = {s.name: torch.zeros(s.batch_shape(2, *shape)) for s in rule.state_specs()}
    whole = []
    for s in range(steps):
        U, scale = rule.update(G[s], state, hp | blocks, step=s + 1)
        whole.append(U * scale)
    calls: list[int] = []
    split = run_split(name, G, sizes, dim, steps, hp={"period": 2}, calls=calls)
    err = (split - torch.stack(whole)).abs().max().item() / whole[0].abs().max().item()
    assert err < 1e-4, f"{shape} split {sizes} along {dim}: relative error {err:.2e}"
    assert calls and set(calls) == {2}, calls  # a reduce in the full step only


def test_a_rule_that_needs_the_whole_matrix_refuses_a_split():
    split = MatrixSplit(-1, (4, 8), lambda t, op: t, ("one",))
    rule = get_rule("musec")
    state = {s.name: torch.zeros(s.batch_shape(1, 4, 4)) for s in rule.state_specs()}
    with pytest.raises(ValueError, match=r"rule 'musec' cannot step a shard.*SpectralClip"):
        rule.update(torch.randn(1, 4, 4), state, rule_hp("musec"), split=split)


def test_matrix_split_checks_its_dimension():
    with pytest.raises(ValueError, match="-2 \\(rows\\) or -1 \\(columns\\), got 0"):
        MatrixSplit(0, (4, 8), lambda t, op: t, ("one",))


@pytest.mark.parametrize(
    ("x_dtype", "compute", "sizes", "gathers"),
    [
        (torch.float32, "float16", (2, 4), False),  # fp16 Gram matrices: half the bytes
        (torch.float32, "float32", (4, 4), True),
        (torch.bfloat16, "float32", (4, 2), True),  # bf16 shards gathered, fp32 Gram
    ],
)
def test_auto_path_prices_the_gram_in_the_compute_dtype_and_the_gather_in_x(
    x_dtype, compute, sizes, gathers
):
    """``tp_path="auto"`` on a 4096 × 5120 matrix split by rows over 4 (Gram side 5120,
    the long one): the Gram all-reduces travel in ``ns_compute_dtype``, the gathered
    shards in the chain's dtype (``X``'s), and the choice is the one
    ``tensor_parallel_path`` makes at those sizes. At one size for both (4 bytes, as
    before) the fp16 case gathered."""
    from dmuon.comm import tensor_parallel_path
    from dmuon.optim.transforms.base import StepContext

    m, n, t = 4096, 5120, 4
    X = torch.empty(1, m // t, n, dtype=x_dtype, device="meta")  # shapes and dtype only
    split = MatrixSplit(-2, (m, n), lambda x, op: x, ("tp", (0, 1, 2, 3)), world_size=t)
    split = dataclasses.replace(split, gather=lambda x: x)
    ctx = StepContext(X, HP | {"ns_compute_dtype": compute, "tp_path": "auto"}, split=split)
    gram_e, gather_e = sizes
    want = tensor_parallel_path(
        m, n, -2, t, gram_element_size=gram_e, gather_element_size=gather_e, steps=5
    )
    assert (want.path == "gather") == gathers
    assert ctx._gathers(X, "gram", 5) == gathers
