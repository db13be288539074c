"""``check_every=N`` compares the parameters across ranks and names the one that diverged.

Every rank must hold the same value of every parameter it holds whole (FSDP2 shards
differ by design and are left out). The check must not fire on a healthy run, in
any mode, and must fire — on every rank, naming the parameter and the rank — when
one rank's copy is changed behind the optimizer's back (as a bug in a custom
training loop, a bad checkpoint load or a rank-dependent update would).
"""

from __future__ import annotations

import torch
from distributed_cases import OPT, batch, full_params, loss_of, max_diff, setup

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import RankDivergenceError

NAME = "mixed"
HEALTHY = ["owner_fsdp", "owner_ddp", "replicated", "sharded", "sign"]
# modes where a whole copy of head.bias lives on each rank
DIVERGED = ["owner_ddp", "replicated", "sign"]


def run_agreement(rank: int, world: int):
    out = {}
    for mode in HEALTHY:
        _, forward, opt, _ = setup(mode, NAME, world, dict(OPT, check_every=1))
        for t in range(2):
            loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
            opt.step()  # raises RankDivergenceError if the ranks disagree
            opt.zero_grad()
        out["healthy", mode] = opt.steps_taken
    for mode in DIVERGED:
        model, forward, opt, _ = setup(mode, NAME, world, dict(OPT, check_every=2))
        raised = []
        for t in range(4):
            if t == 2 and rank == 1:
                with torch.no_grad():
                    model.head.bias[0] += 1e-3  # rank 1 alone: a silent divergence
            loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
            try:
                opt.step()
            except RankDivergenceError as err:
                raised.append((t, str(err), err.names, err.ranks))
            opt.zero_grad()
        out["diverged", mode] = raised
    # rank 1 lists the same parameters in another order (groups and parameters
    # reversed): the same model, so no divergence may be reported, and the ranks end equal
    model, forward, _, ded = setup("owner_ddp", NAME, world, dict(OPT, check_every=1))
    from dmuon.optim import DMuon, param_groups

    groups = param_groups(model)
    if rank == 1:
        groups = [
            dict(g, params=g["params"][::-1], param_names=g["param_names"][::-1]) for g in groups
        ][::-1]
    opt = DMuon(groups, **dict(OPT, check_every=1, distributed=ded))
    for t in range(2):
        loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    ded.wait()
    out["reordered"] = full_params(model)
    return out


def test_parameter_checksums_agree_on_healthy_runs_and_name_a_diverged_parameter():
    world = 3
    results = run_on_ranks(run_agreement, world, timeout=240)
    for rank, res in enumerate(results):
        for mode in HEALTHY:
            assert res["healthy", mode] == 2, f"{mode}, rank {rank}"
        for mode in DIVERGED:
            raised = res["diverged", mode]
            # checks run after steps 2 and 4 (t = 1, 3); the change happened before t = 2
            assert [r[0] for r in raised] == [3], f"{mode}, rank {rank}: {raised}"
            _, text, names, ranks = raised[0]
            assert names == ["head.bias"] and ranks == [[1]], f"{mode}, rank {rank}: {text}"
            assert "'head.bias'" in text and "rank(s) [1]" in text, text
        same, where = max_diff(res["reordered"], results[0]["reordered"])
        assert same == 0.0, f"reordered groups: rank {rank} differs from rank 0 at {where}"


def run_reads(rank: int, world: int) -> tuple[int, int]:
    from dmuon.optim.engine.guards import check_agreement

    _, forward, opt, _ = setup("replicated", NAME, world, dict(OPT))
    loss_of(NAME, forward, *batch(NAME, 0, rank, world)).backward()
    opt.step()
    reads = 0
    int_of, item_of = torch.Tensor.__int__, torch.Tensor.item

    def counted(read):
        def read_counted(self, *args):
            nonlocal reads
            reads += 1
            return read(self, *args)

        return read_counted

    torch.Tensor.__int__, torch.Tensor.item = counted(int_of), counted(item_of)  # type: ignore[method-assign]
    try:
        compared = check_agreement(opt.engine)
    finally:
        torch.Tensor.__int__, torch.Tensor.item = int_of, item_of  # type: ignore[method-assign]
    return compared, reads


def test_the_check_reads_its_checksums_back_once_not_one_by_one():
    """Each parameter's checksum stays a tensor until the all-gather's one read: a
    read per parameter (``int()`` of each) was a device synchronisation each on GPUs."""
    for compared, reads in run_on_ranks(run_reads, 2, timeout=120):
        assert compared > 4, compared
        assert reads == 0, f"{reads} scalar reads for {compared} parameters"
