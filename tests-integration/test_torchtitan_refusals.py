"""What ``DMuonOptimizersContainer`` refuses, and the model it leaves after a refusal.

* A model prepared by ``parallelize_for_owners`` (its matrices left out of FSDP2) with
  the container in another mode: nothing would sum those matrices' gradients over the
  ranks (``single``: each rank steps its own, the ranks drift; ``replicated``: each
  matrix steps with its owner's local gradient). Refused on every rank, naming
  ``parallelize_for_owners`` and ``mode='owner'``; the model is left as it was, so the
  owner-mode container built next trains as one process does.
* An owner-mode build refused after the matrices were dedicated (a bad DMuon option, or
  dedicated matrices that differ from those FSDP2 left out): the matrices are let go,
  so the corrected build on the same model trains as one process does.
* ``split_sizes`` on torchtitan's fused ``wqkv`` (``FusedQKVLinear`` interleaves q, k
  and v rows per key/value head): refused, naming the parameter.

On gloo, world 2, with ``test_torchtitan``'s model, loss and one-process reference.
"""

from __future__ import annotations

import pytest
from tensor_parallel_cases import error
from test_torchtitan import (
    OPT,
    SPLIT,
    STEPS,
    check_owner_run,
    one_process_titan_loss,
    owner_container,
    owner_model,
    owner_train,
    whole,
)
from torchtitan.components.optimizer import ParamGroupConfig

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations.torchtitan import DMuonOptimizersContainer, dmuon_optimizer

FUSED = "layers.0.attention.qkv_linear.wqkv.weight"


def refuse_other_modes(model) -> dict[str, str | None]:
    return {
        mode: error(
            lambda mode=mode: dmuon_optimizer(mode=mode, split_sizes=SPLIT, **OPT).build(
                model_parts=[model]
            )
        )
        for mode in ("single", "replicated", "sharded")
    }


def refuse_an_option(model) -> dict[str, str | None]:
    bad = dmuon_optimizer(mode="owner", split_sizes=SPLIT, **{**OPT, "lrr": 0.02})
    return {"option": error(lambda: bad.build(model_parts=[model]))}


def refuse_a_mismatch(model) -> dict[str, str | None]:
    """A matrix frozen after ``parallelize_for_owners``: not dedicated, yet FSDP2 left it out."""
    wo = next(p for n, p in model.named_parameters() if n.endswith("attention.wo.weight"))
    wo.requires_grad_(False)
    try:
        return {"mismatch": error(lambda: owner_container(model))}
    finally:
        wo.requires_grad_(True)


REFUSALS = {"modes": refuse_other_modes, "option": refuse_an_option, "mismatch": refuse_a_mismatch}


def run_refused_then_owner(rank, world, refusal):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = owner_model(mesh)
    messages = REFUSALS[refusal](model)
    container = owner_container(model)  # the corrected build, on the same model
    norms, leftover = owner_train(model, container, range(STEPS), slice(2 * rank, 2 * rank + 2))
    container.dedication.wait()
    return dict(
        messages=messages,
        mode=container.dmuon.engine.mode,
        leftover=leftover,
        norms=norms,
        weights=whole(model),
    )


def test_another_mode_on_a_model_parallelised_for_owners_is_refused_and_owner_mode_then_runs():
    expected, norms = one_process_titan_loss()
    results = run_on_ranks(run_refused_then_owner, 2, args=("modes",), timeout=120)
    for rank, out in enumerate(results):
        for mode, message in out["messages"].items():
            assert message is not None, f"rank {rank}: mode {mode!r} built, no error"
            assert f"mode={mode!r}" in message, message
            assert "parallelize_for_owners" in message and "mode='owner'" in message, message
    assert results[0]["messages"] == results[1]["messages"]
    check_owner_run(results, expected, norms)


@pytest.mark.parametrize("refusal", ["option", "mismatch"])
def test_a_refused_owner_mode_build_leaves_the_model_to_the_corrected_one(refusal):
    expected, norms = one_process_titan_loss()
    results = run_on_ranks(run_refused_then_owner, 2, args=(refusal,), timeout=120)
    for rank, out in enumerate(results):
        message = out["messages"][refusal]
        assert message is not None, f"rank {rank}: the bad build was not refused"
        assert {"option": "'lrr'", "mismatch": "attention.wo.weight"}[refusal] in message
    check_owner_run(results, expected, norms)


def test_split_sizes_on_torchtitans_fused_wqkv_are_refused():
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:1]
    model = config.build()
    rows = model.layers["0"].attention.qkv_linear.wqkv.weight.shape[0]
    sizes = [rows // 3] * 3  # the q | k | v blocks a fused projection in that order would take
    by_config = error(
        lambda: dmuon_optimizer(mode="single", split_sizes={r"wqkv\.weight$": sizes}).build(
            model_parts=[model]
        )
    )
    groups = [
        ParamGroupConfig(
            pattern=r"wqkv\.weight$",
            optimizer_name="DMuon",
            optimizer_kwargs={"split_sizes": tuple(sizes)},
        ),
        ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={"rule": "scalar"}),
    ]
    by_group = error(
        lambda: DMuonOptimizersContainer.Config(mode="single", param_groups=groups).build(
            model_parts=[model]
        )
    )
    for message in (by_config, by_group):
        assert message is not None, "contiguous split_sizes on FusedQKVLinear's wqkv accepted"
        assert repr(FUSED) in message and "FusedQKVLinear" in message, message
        assert "num_heads=" in message, message
