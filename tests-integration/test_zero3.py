"""ZeRO-3-like owner mode (``reshard_after_forward=True``) trains like one process, keeps
only owned matrices between layers, and moves 3(N−1)/N·P bytes per step (broadcast for
forward, re-broadcast for backward, reduce)."""

import pytest
import torch
from distributed_cases import (
    STEPS,
    TOLERANCE,
    batch,
    build,
    loss_of,
    max_diff,
    reference,
    run_modes,
)

from dmuon.comm.testing import run_on_ranks

NAME = "gpt"


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_like_owner_mode_equals_one_process(world):
    expected = reference(NAME, world)
    modes = ["owner_fsdp_z3", "owner_ddp_z3"]
    results = run_on_ranks(run_modes, world, args=(NAME, modes, STEPS), timeout=180)
    for rank in range(world):
        for mode in modes:
            diff, where = max_diff(results[rank][mode], expected)
            assert diff <= TOLERANCE, f"{mode}, rank {rank}: {where} differs by {diff:.2e}"


def run_memory_and_bytes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.comm import CommStats
    from dmuon.integrations import fsdp
    from dmuon.optim import DMuon, param_groups

    model = build(NAME)
    stats = CommStats()
    mesh = init_device_mesh("cpu", (world,))
    ded = fsdp.dedicate(model, mesh, reshard_after_forward=True, stats=stats)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ded.params)
    fully_shard(model, mesh=mesh, ignored_params=ded.params)
    opt = DMuon(param_groups(model), distributed=ded, ns_compute_dtype="float32")
    params = dict(model.named_parameters())
    held = []
    for t in range(2):
        stats.reset()
        loss_of(NAME, model, *batch(NAME, t, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        held.append({n: 0 not in params[n].stride() for n in ded.names})
        freed = all(
            b.buffer.untyped_storage().nbytes() == 0
            for layer in ded.exchange.layers
            for b in layer.publish_buckets
            if b.owner != rank
        )
        assert freed, "a bucket this rank does not own still holds memory"
        ops = stats.ops
        sent = ops["reduce_to_owners"].bytes_sent + ops["broadcast_from_owners"].bytes_sent
    P = sum(i.nbytes for i in ded.plan.items)
    # a freed weight read outside a forward is NaN (it used to read freed memory and
    # crash the process), keeps its shape, and refuses writes
    errors = []
    for n in sorted(set(ded.names) - set(ded.owned)):
        p = params[n]
        errors.append(p.detach().sum().isnan().item() and p.ndim == 2)
        try:
            with torch.no_grad():
                p.add_(1.0)
            errors.append(False)
        except RuntimeError:
            errors.append(True)
    try:
        model.state_dict()
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    ded.wait()  # every rank: all weights materialised
    gathered = {n: params[n].detach().clone() for n in ded.names}
    state = model.state_dict()  # now allowed
    return held, sorted(ded.owned), sent, P, errors, refused, gathered, len(state)


def test_zero3_like_frees_what_a_rank_does_not_own_and_moves_three_halves_of_a_ring():
    world = 2
    results = run_on_ranks(run_memory_and_bytes, world, timeout=120)
    for held, owned, sent, P, errors, refused, _, n_state in results:
        for step in held:
            assert sorted(n for n, kept in step.items() if kept) == owned
        assert sent == pytest.approx(3 * (world - 1) / world * P, rel=0.01)
        assert errors and all(errors), errors
        assert "freed on this rank" in refused and "ded.wait()" in refused, refused
        assert n_state > 0
    # after ded.wait() every rank holds every weight, the owners' values
    first = results[0][6]
    for other in results[1:]:
        for n, w in other[6].items():
            assert torch.equal(w, first[n]), n


def run_checkpoint_round_trip(rank, world, path):
    from distributed_cases import full_params, setup

    from dmuon.integrations import checkpoint

    def train(forward, opt, start, stop):
        for t in range(start, stop):
            loss_of(NAME, forward, *batch(NAME, t, rank, world)).backward()
            opt.step()
            opt.zero_grad()

    model, forward, opt, ded = setup("owner_fsdp_z3", NAME, world)
    train(forward, opt, 0, 2)
    checkpoint.save(path, model, opt)  # saves freed weights too: it materialises them
    train(forward, opt, 2, 4)
    ded.wait()
    expected = full_params(model)
    model, forward, opt, ded = setup("owner_fsdp_z3", NAME, world)
    checkpoint.load(path, model, opt)
    train(forward, opt, 2, 4)
    ded.wait()
    return max_diff(full_params(model), expected)


def test_zero3_like_checkpoint_round_trip_resumes_exactly(tmp_path):
    for diff, where in run_on_ranks(
        run_checkpoint_round_trip, 2, args=(str(tmp_path / "dcp"),), timeout=180
    ):
        assert diff == 0.0, f"{where} differs by {diff:.2e}"


def run_loads(rank, world):
    """ZeRO-3-like ``ddp.dedicate`` after a step: a ``strict=False`` load of entries that
    are not dedicated matrices; a load of every entry (this rank's freed ones among them);
    then the same after ``ded.wait()``."""
    from dmuon.integrations import ddp
    from dmuon.optim import DMuon, param_groups

    model = build(NAME)
    ded = ddp.dedicate(model, reshard_after_forward=True)
    opt = DMuon(param_groups(model), distributed=ded, ns_compute_dtype="float32")
    loss_of(NAME, model, *batch(NAME, 0, rank, world)).backward()
    opt.step()
    opt.zero_grad()
    freed = ded.exchange.publication.released_names()
    others = {n: torch.zeros(p.shape) for n, p in model.named_parameters() if n not in ded.names}
    model.load_state_dict(others, strict=False)
    params = dict(model.named_parameters())
    zeroed = all(float(params[n].detach().abs().max()) == 0 for n in others)
    whole = {n: torch.ones(p.shape) for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        model.load_state_dict(whole, strict=False)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    # refused before anything was copied (the modules ahead of the first freed weight's
    # were loaded, and the ranks then drifted apart)
    unchanged = all(
        torch.equal(p.detach(), before[n]) or bool(torch.isnan(p.detach()).all())
        for n, p in model.named_parameters()
    )
    ded.wait()
    model.load_state_dict(whole, strict=False)
    loaded = all(bool((p.detach() == 1).all()) for p in model.parameters())
    return freed, zeroed, refused, unchanged, loaded


def test_zero3_like_loads_refuse_only_a_write_into_a_freed_weight():
    for rank, (freed, zeroed, refused, unchanged, loaded) in enumerate(
        run_on_ranks(run_loads, 2, timeout=120)
    ):
        assert freed, f"rank {rank} frees nothing: the test would prove nothing"
        assert zeroed, f"rank {rank}: the load of the entries that are not dedicated failed"
        assert refused is not None and "is freed on this rank" in refused, (rank, refused)
        assert any(f"{n!r}" in refused for n in freed), (rank, refused, freed)
        assert unchanged, f"rank {rank}: the refused load changed weights"
        assert loaded, f"rank {rank}: the load after ded.wait() did not take every weight"
