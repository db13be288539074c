"""Every wrong input in the table gives a clear error: its type and the words that say
what was wrong and what would be right.

``CASES`` is the table. Single-process rows are one parametrised test each; the
rows that need a process group run together in one ``run_on_ranks`` call of two
ranks (every rank must raise, none may hang). ``docs/troubleshooting.md`` carries
the same table between two markers; ``test_the_troubleshooting_page_lists_the_table``
fails when they drift apart, and ``python tests-integration/test_bad_config.py``
rewrites the page's table from ``CASES``.

The DeepSpeed rows go through ``check_config``, the pure check that
``dmuon.integrations.deepspeed.initialize`` runs on every rank before any
collective (``tests-integration/test_deepspeed.py`` shows the same error raised by
``initialize`` on two real ranks).
"""

from __future__ import annotations

import pathlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dmuon.integrations.deepspeed import UnsupportedConfigError, check_config
from dmuon.kernels import spectral_clip
from dmuon.optim import DMuon, ModelMismatchError, param_groups

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
BEGIN, END = "<!-- bad-config table: begin -->", "<!-- bad-config table: end -->"


@dataclass(frozen=True)
class Case:
    """One wrong input: what it is, the code that does it, and the error it must give."""

    id: str
    wrong: str  # what the user did (Markdown)
    run: Callable[..., object]  # single: run(); ranks: run(rank, world)
    error: type[BaseException]
    says: str  # a literal part of the message
    ranks: int = 1


def W(rows: int = 4, cols: int = 6) -> nn.Parameter:
    return nn.Parameter(torch.randn(rows, cols))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _fsdp_dedicate(model: nn.Module, **options) -> object:
    from dmuon.integrations import fsdp

    return fsdp.dedicate(model, **options)


def _items() -> list:
    from dmuon.comm import MatrixItem

    return [MatrixItem("a", (4, 6)), MatrixItem("b", (8, 8))]


def _plan(**options) -> None:
    from dmuon.comm import plan_owners

    plan_owners(_items(), 2, **options)


def _dedicate(kind: str, model: object, **options) -> None:
    from dmuon.integrations import ddp, fsdp

    (ddp if kind == "ddp" else fsdp).dedicate(model, **options)


def _orthogonalize(G: torch.Tensor, **options) -> None:
    from dmuon.kernels import orthogonalize

    orthogonalize(G, **options)


def _matrix_item(*args) -> None:
    from dmuon.comm import MatrixItem

    MatrixItem(*args)


def _qk_clip(**options) -> None:
    from dmuon.optim import QKClip

    QKClip(nn.MultiheadAttention(8, 2), **options)


def _dedicate_without_process_group() -> None:
    from unittest import mock

    from dmuon.integrations import ddp

    with mock.patch.dict("os.environ", {"WORLD_SIZE": "2"}):  # as torchrun sets it
        ddp.dedicate(net())


def _optimizer_without_process_group(mode: str | None) -> None:
    from unittest import mock

    with mock.patch.dict("os.environ", {"WORLD_SIZE": "2"}):  # as torchrun sets it
        DMuon(param_groups(net()), mode=mode)


def _dedicate_ddp_wrapped(rank: int, world: int) -> None:
    from dmuon.integrations import ddp

    ddp.dedicate(nn.parallel.DistributedDataParallel(net()))


def _deepspeed_zero3() -> None:
    check_config({"zero_optimization": {"stage": 3}})


def _deepspeed_zero2_replicated() -> None:
    check_config({"zero_optimization": {"stage": 2}}, mode="replicated")


def _deepspeed_initialize_with_dmuon() -> None:
    # What deepspeed.initialize(model=model, optimizer=DMuon(...), ...) does at ZeRO stage
    # 1/2: each group's parameters become one flat fp32 partition of the rank.
    model = net()
    opt = DMuon(param_groups(model), lr=0.02)
    for group in opt.param_groups:
        flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in group["params"]]))
        flat.grad = torch.zeros_like(flat)
        group["params"] = [flat]
    opt.step()


def _two_groups() -> None:
    w = W()
    DMuon([{"params": [w]}, {"params": [w]}])


def _edited_state_dict(index: int, key: str, value: torch.Tensor) -> None:
    model = net()
    opt = DMuon(param_groups(model))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"][index][key] = value
    opt.load_state_dict(sd)


def _clip_parameters() -> None:
    from dmuon.optim import clip_grad_norm_

    model = net()
    model(torch.randn(3, 4)).sum().backward()
    clip_grad_norm_(model.parameters(), 1.0)


def _dedicate_after_fully_shard(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import fsdp

    mesh = init_device_mesh("cpu", (world,))
    model = net()
    fully_shard(model, mesh=mesh)
    fsdp.dedicate(model, mesh)


def _optimizer_before_dedicate(rank: int, world: int) -> None:
    from dmuon.integrations import ddp

    model = net()
    opt = DMuon(param_groups(model), mode="replicated")
    ddp.dedicate(model)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def _sign_with_dedication(rank: int, world: int) -> None:
    from dmuon.integrations import ddp

    model = net()
    DMuon(param_groups(model), rule="sign_muon", distributed=ddp.dedicate(model))


def _sign_with_fully_shard(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))  # norms only: no matrix refused first
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    DMuon(param_groups(model), mode="sign")


def _mesh_larger_than_world(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.integrations import fsdp

    fsdp.dedicate(net(), init_device_mesh("cpu", (world + 1,)))


def _no_mode_with_group(rank: int, world: int) -> None:
    DMuon(param_groups(net()))


def _mode_contradicts_dedication(rank: int, world: int) -> None:
    from dmuon.integrations import ddp

    model = net()
    DMuon(param_groups(model), distributed=ddp.dedicate(model), mode="replicated")


def _other_model_dedicated(rank: int, world: int) -> None:
    from dmuon.integrations import ddp

    ded = ddp.dedicate(net())
    DMuon(param_groups(net()), distributed=ded)


def _model_differs(rank: int, world: int) -> None:
    model = net() if rank == 0 else nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 2))
    DMuon(param_groups(model), mode="replicated")


def _state_dict_of_another_rank(rank: int, world: int) -> None:
    from dmuon.comm import all_gather_objects
    from dmuon.integrations import ddp

    model = net()
    opt = DMuon(param_groups(model), distributed=ddp.dedicate(model))  # one matrix per rank
    dicts = all_gather_objects(opt.state_dict())
    opt.load_state_dict(dicts[(rank + 1) % world])


CASES = [
    Case("lr-negative", "`lr=-1.0`", lambda: DMuon([W()], lr=-1.0), ValueError,
         "lr must be a finite real number >= 0.0, got -1.0"),
    Case("lr-nan", "`lr=float('nan')`", lambda: DMuon([W()], lr=float("nan")), ValueError,
         "lr must be a finite real number"),
    Case("lr-string", "`lr='1e-3'` (a string, as PyYAML reads `1e-3`)",
         lambda: DMuon([W()], lr="1e-3"), ValueError,
         "lr must be a finite real number >= 0.0, got the string '1e-3': pass a number, "
         "float('1e-3')"),
    Case("momentum-one", "`momentum=1.0`", lambda: DMuon([W()], momentum=1.0), ValueError,
         "momentum must be a real number in [0.0, 1.0), got 1.0"),
    Case("momentum-negative", "`momentum=-0.1`", lambda: DMuon([W()], momentum=-0.1),
         ValueError, "momentum must be a real number in [0.0, 1.0)"),
    Case("weight-decay-negative", "`weight_decay=-1.0`",
         lambda: DMuon([W()], weight_decay=-1.0), ValueError, "weight_decay must be a finite"),
    Case("lr-past-float32", "`lr=1e300` (finite in Python, past float32's 3.4e38)",
         lambda: DMuon([W()], lr=1e300), ValueError,
         "lr must be a finite real number >= 0.0 and at most 3.403e+38 in magnitude"),
    Case("lr-times-weight-decay", "`lr=1e20, weight_decay=1e20`",
         lambda: DMuon([W()], lr=1e20, weight_decay=1e20), ValueError,
         "lr × weight_decay = 1e+40 is past float32's largest"),
    Case("adamw-step-size", "`adamw_lr=1e38` (AdamW's first step, lr / (1 − β₁), overflows)",
         lambda: DMuon(param_groups(net()), adamw_lr=1e38), ValueError,
         "lr / (1 − beta1), AdamW's first step size = 1e+39 is past float32's largest"),
    Case("ns-steps-zero", "`ns_steps=0`", lambda: DMuon([W()], ns_steps=0), ValueError,
         "ns_steps must be an integer >= 1, got 0"),
    Case("ns-steps-float", "`ns_steps=2.5`", lambda: DMuon([W()], ns_steps=2.5), ValueError,
         "ns_steps must be an integer >= 1, got 2.5"),
    Case("ns-steps-huge", "`ns_steps=2**62`", lambda: DMuon([W()], ns_steps=2**62),
         ValueError, "ns_steps must be an integer in [1, 100], got 4611686018427387904"),
    Case("coefficients-unknown", "`ns_coefficients='nope'`",
         lambda: DMuon([W()], ns_coefficients="nope"), ValueError,
         "ns_coefficients must be one of ['keller', 'polar_express'"),
    Case("coefficients-pair", "`ns_coefficients=[(1.0, 2.0)]` (not a triple)",
         lambda: DMuon([W()], ns_coefficients=[(1.0, 2.0)]), ValueError,
         "must be an (a, b, c) triple"),
    Case("coefficients-nan", "`ns_coefficients=[(nan, 1, 1)]`",
         lambda: DMuon([W()], ns_coefficients=[(float("nan"), 1.0, 1.0)]), ValueError,
         "coefficients[0] must be three finite real numbers"),
    Case("ns-method", "`ns_method='svd'`", lambda: DMuon([W()], ns_method="svd"), ValueError,
         "ns_method must be one of ['gram', 'standard'], got 'svd'"),
    Case("adjust-lr", "`adjust_lr='weird'`", lambda: DMuon([W()], adjust_lr="weird"),
         ValueError, "adjust_lr must be one of ['original', 'match_rms_adamw'"),
    Case("rule-unknown", "`rule='adam'`", lambda: DMuon([W()], rule="adam"), ValueError,
         "unknown rule 'adam'; expected one of"),
    Case("group-rule-unknown", "a group with `rule='sgd'`",
         lambda: DMuon([{"params": [W()], "rule": "sgd"}]), ValueError,
         "unknown rule 'sgd'; expected one of"),
    Case("rule-option-unknown", "`DMuon(..., rule='muon', beta2=0.9)` (NorMuon's option)",
         lambda: DMuon([W()], rule="muon", beta2=0.9), ValueError,
         "unknown option(s) ['beta2'] for rule(s) ['muon'] (beta2= is an option of rule(s) "
         "['adamuon', 'dion3', 'muon2', 'normuon'])"),
    Case("keyword-misspelt", "`DMuon(..., adamw_lrr=1e-3)` (a misspelt keyword)",
         lambda: DMuon([W()], adamw_lrr=1e-3), ValueError,
         "unknown option(s) ['adamw_lrr'] for rule(s) ['muon'] (adamw_lrr=: did you mean "
         "adamw_lr=?)"),
    Case("adamw-keyword", "`DMuon(..., betas=(0.9, 0.95))` (AdamW's keyword)",
         lambda: DMuon([W()], betas=(0.9, 0.95)), ValueError,
         "unknown option(s) ['betas'] for rule(s) ['muon'] (betas= is adamw_betas= here"),
    Case("muon-eps", "`DMuon(..., eps=1e-7)` (`torch.optim.Muon`'s Newton–Schulz floor)",
         lambda: DMuon([W()], eps=1e-7), ValueError,
         "torch.optim.Muon's eps, the floor of its Newton–Schulz normalisation, has no "
         "keyword here"),
    Case("param-groups-of-parameters", "`param_groups(model.parameters())`",
         lambda: param_groups(net().parameters()), TypeError,
         "call param_groups(model), not param_groups(model.parameters())"),
    Case("rule-option-range", "`rule='dion2', fraction=1.5`",
         lambda: DMuon([W()], rule="dion2", fraction=1.5), ValueError,
         "fraction must be a real number in (0.0, 1.0], got 1.5"),
    Case("meta-parameters",
         "`DMuon(param_groups(model))` on a model built under `torch.device('meta')`",
         lambda: DMuon([torch.empty(4, 4, device="meta", requires_grad=True)]), ValueError,
         "is on the meta device (no storage); build the optimizer after the model is "
         "materialised"),
    Case("layer-pack-negative", "`DMuon(..., layer_pack_mb=-1)`",
         lambda: DMuon([W()], layer_pack_mb=-1), ValueError,
         "layer_pack_mb must be a number of MiB >= 0 (0: every layer on its own), got -1"),
    Case("clip-steps-huge", "`rule='musec', clip_steps=10**9`",
         lambda: DMuon([W()], rule="musec", clip_steps=10**9), ValueError,
         "clip_steps must be an integer in [1, 100], got 1000000000"),
    Case("power-iters-huge", "`rule='numuon', power_iters=10**9`",
         lambda: DMuon([W()], rule="numuon", power_iters=10**9), ValueError,
         "power_iters must be an integer in [0, 100], got 1000000000"),
    Case("spectral-clip-steps-huge", "`spectral_clip(M, steps=10**9, mode='soft')`",
         lambda: spectral_clip(torch.randn(4, 4), steps=10**9, mode="soft"), ValueError,
         "steps must be an integer from 1 to 100"),
    Case("group-key-unknown", "a group with the key `lrr` (typo)",
         lambda: DMuon([{"params": [W()], "lrr": 0.1}]), ValueError,
         "unknown key(s) ['lrr'] for rule 'muon'"),
    Case("scalar-optimizer", "`scalar_optimizer='sgd'`",
         lambda: DMuon([W()], scalar_optimizer="sgd"), ValueError,
         "scalar_optimizer must be one of ['adamw', 'lion'], got 'sgd'"),
    Case("adamw-betas", "`adamw_betas=(0.9, 1.5)`",
         lambda: DMuon([W()], adamw_betas=(0.9, 1.5)), ValueError,
         "adamw_betas must be a pair (beta1, beta2) in [0, 1)"),
    Case("param-names-length", "a group with 2 `params` and 1 name in `param_names`",
         lambda: DMuon([{"params": [W(), W()], "param_names": ["w"]}]), ValueError,
         "param group 0: param_names has 1 name(s) for 2 parameter(s)"),
    Case("param-names-string", "`param_names='ab'` (a string, not a list)",
         lambda: DMuon([{"params": [W(), W()], "param_names": "ab"}]), TypeError,
         "param group 0: param_names must be a list of strings, one per parameter"),
    Case("clip-parameters", "`clip_grad_norm_(model.parameters(), 1.0)` (torch's signature)",
         _clip_parameters, TypeError,
         "call clip_grad_norm_(opt, max_norm) with the DMuon optimizer, not model.parameters()"),
    Case("vector-in-matrix-group", "a 1-D parameter (a bias) in a matrix group",
         lambda: DMuon([{"params": [nn.Parameter(torch.zeros(6))], "rule": "muon"}]),
         ValueError, "matrix rules take parameters with at least 2 dimensions"),
    Case("param-in-two-groups", "one parameter in two groups", _two_groups, ValueError,
         "appears in more than one parameter group (it is already in param group 0)"),
    Case("integer-param", "an integer tensor as a parameter",
         lambda: DMuon([torch.zeros(4, 4, dtype=torch.int64)]), ValueError,
         "DMuon optimizes real floating-point parameters"),
    Case("non-leaf", "a tensor computed from a parameter (`weight * 2`)",
         lambda: DMuon([W() * 2]), ValueError,
         "is not a leaf tensor (it was computed from others"),
    Case("non-contiguous", "a transposed (non-contiguous) matrix",
         lambda: DMuon([nn.Parameter(torch.randn(6, 4).t())]), ValueError,
         "is not contiguous; matrix rules update parameters through views"),
    Case("mode-unknown", "`mode='zero'`", lambda: DMuon([W()], mode="zero"), ValueError,
         "mode must be one of ('single', 'owner', 'replicated', 'sharded', 'sign')"),
    Case("owner-without-dedication", "`mode='owner'` without `dedicate()`",
         lambda: DMuon([W()], mode="owner"), ValueError,
         "mode='owner' needs dedicated parameters"),
    Case("sharded-without-fsdp", "`mode='sharded'` on plain tensors",
         lambda: DMuon([W()], mode="sharded"), ValueError,
         "sharded mode steps FSDP2's sharded matrices"),
    Case("pipeline-depth", "`pipeline_depth=0`", lambda: DMuon([W()], pipeline_depth=0),
         ValueError, "pipeline_depth must be an int ≥ 1, got 0"),
    Case("timeout", "`timeout=-1`", lambda: DMuon([W()], timeout=-1), ValueError,
         "timeout must be a positive number of seconds"),
    Case("timeout-inf", "`timeout=math.inf` (`None` waits as long as the process group)",
         lambda: DMuon([W()], timeout=float("inf")), ValueError,
         "timeout must be a positive number of seconds"),
    Case("nonfinite-policy", "`nonfinite='ignore'`", lambda: DMuon([W()], nonfinite="ignore"),
         ValueError, "nonfinite must be 'raise', 'skip_step' or None"),
    Case("check-every", "`check_every=0`", lambda: DMuon([W()], check_every=0), ValueError,
         "check_every must be an int ≥ 1"),
    Case("store", "`store='localhost:29500'` (an address, not a store)",
         lambda: DMuon([W()], store="localhost:29500"), ValueError,
         "store must be a torch.distributed.Store"),
    Case("state-dict-incomplete", "`load_state_dict({'state': {}})`",
         lambda: DMuon([W()]).load_state_dict({"state": {}}), ValueError,
         "state dict is missing key(s) ['param_groups']"),
    Case("state-dict-negative-step", "`load_state_dict()` of a dict whose `step` is -1",
         lambda: _edited_state_dict(2, "step", torch.tensor(-1.0)), ValueError,
         "state 'step' of parameter '0.bias' (param group 1, shape (8,)) holds a negative "
         "value"),
    Case("state-dict-negative-second-moment",
         "`load_state_dict()` of a dict whose AdamW `exp_avg_sq` is negative",
         lambda: _edited_state_dict(2, "exp_avg_sq", -torch.ones(8)), ValueError,
         "it is a running mean of squares, never negative"),
    Case("no-mode-with-group", "no `mode` under a process group of 2 ranks, no dedication",
         _no_mode_with_group, ValueError, "DMuon cannot tell how the gradients arrive", 2),
    Case("dedicate-reduce-op", "`fsdp.dedicate(model, reduce_op='mean')`",
         lambda: _fsdp_dedicate(net(), reduce_op="mean"), ValueError,
         "reduce_op must be 'avg' (gradients averaged over the ranks"),
    Case("dedicate-without-process-group",
         "`dedicate()` under `torchrun` (`WORLD_SIZE=2`) without `init_process_group()`",
         _dedicate_without_process_group, RuntimeError,
         "Call torch.distributed.init_process_group() on every rank before dedicate()"),
    Case("optimizer-without-process-group",
         "`DMuon(...)` (no `mode`) under `torchrun` (`WORLD_SIZE=2`) without "
         "`init_process_group()`",
         lambda: _optimizer_without_process_group(None), RuntimeError,
         "Call torch.distributed.init_process_group() on every rank before DMuon(...)"),
    Case("replicated-without-process-group",
         "`DMuon(..., mode='replicated')` under `torchrun` without `init_process_group()`",
         lambda: _optimizer_without_process_group("replicated"), RuntimeError,
         "says this process is one of 2 (torchrun or another launcher started it)"),
    Case("dedicate-ddp-wrapped", "`ddp.dedicate(DistributedDataParallel(model))`",
         _dedicate_ddp_wrapped, TypeError, "Pass the model itself, dedicate(model)", 2),
    Case("dedicate-after-fully-shard", "`fsdp.dedicate()` after `fully_shard()`",
         _dedicate_after_fully_shard, ValueError, "dedicate() was called after fully_shard()", 2),
    Case("optimizer-before-dedicate", "`DMuon(...)` built before `dedicate()`",
         _optimizer_before_dedicate, RuntimeError,
         "was dedicated to an owner after this optimizer was built", 2),
    Case("sign-with-dedication", "`rule='sign_muon'` with a dedication",
         _sign_with_dedication, ValueError, "uses rule 'sign_muon', which votes across ranks", 2),
    Case("sign-with-fully-shard", "`mode='sign'` on a model under `fully_shard()`",
         _sign_with_fully_shard, ValueError, "which mode='sign' does not step", 2),
    Case("mode-contradicts-dedication", "a dedication and `mode='replicated'`",
         _mode_contradicts_dedication, ValueError,
         "the parameters are dedicated to owners, which is owner mode", 2),
    Case("dedication-of-another-model", "`distributed=` the dedication of another model",
         _other_model_dedicated, ValueError, "is not dedicated: in owner mode", 2),
    Case("mesh-larger-than-world", "a device mesh of 3 ranks in a world of 2 (raised by torch)",
         _mesh_larger_than_world, RuntimeError, "Mesh should not be bigger than default world", 2),
    Case("model-differs", "rank 1 builds another model (a hidden width of 9, not 8)",
         _model_differs, ModelMismatchError, "the ranks hold different models", 2),
    Case("state-dict-of-another-rank",
         "`load_state_dict()` of a state dict another rank saved (owner mode)",
         _state_dict_of_another_rank, ValueError,
         "is an empty placeholder in this state dict, saved by rank", 2),
    Case("deepspeed-zero3", "DeepSpeed config with ZeRO stage 3 "
         "(`dmuon.integrations.deepspeed.initialize`)", _deepspeed_zero3,
         UnsupportedConfigError, "ZeRO stage 3 is not supported by DMuon: supported are"),
    Case("deepspeed-zero2-replicated", "DeepSpeed ZeRO stage 2 with `mode='replicated'`",
         _deepspeed_zero2_replicated, UnsupportedConfigError,
         "is not supported at ZeRO stage 2 (ZeRO-1/2 would hand DMuon flat slices"),
    Case("deepspeed-initialize-dmuon",
         "`deepspeed.initialize(model=..., optimizer=DMuon(...))` at ZeRO stage 1/2 "
         "(flat partitions in DMuon's groups)", _deepspeed_initialize_with_dmuon,
         RuntimeError, "build it with dmuon.integrations.deepspeed.initialize(model, config, ...)"),
    Case("dedicate-parameters", "`ddp.dedicate(model.parameters())`",
         lambda: _dedicate("ddp", net().parameters()), TypeError,
         "call dedicate(model), not dedicate(model.parameters())"),
    Case("dedicate-stats-int", "`fsdp.dedicate(model, stats=1)`",
         lambda: _dedicate("fsdp", net(), stats=1), TypeError,
         "stats must be None (dmuon.comm.default_stats()) or a dmuon.comm.CommStats"),
    Case("dedicate-layer-of-int", "`ddp.dedicate(model, layer_of=lambda n: 3)`",
         lambda: _dedicate("ddp", net(), layer_of=lambda n: 3), TypeError,
         "layer_of('0.weight') returned 3 (int)"),
    Case("param-groups-split-sizes-list", "`param_groups(model, split_sizes=[16, 16, 16])`",
         lambda: param_groups(net(), split_sizes=[16, 16, 16]), TypeError,
         "split_sizes must be a mapping {regex: value} over parameter names"),
    Case("param-groups-num-heads-int", "`param_groups(model, num_heads=2)`",
         lambda: param_groups(net(), num_heads=2), TypeError,
         "num_heads must be a mapping {regex: value} over parameter names"),
    Case("orthogonalize-float8", "`orthogonalize(G.to(torch.float8_e4m3fn))`",
         lambda: _orthogonalize(torch.randn(4, 6).to(torch.float8_e4m3fn)), ValueError,
         "G must be a real floating-point tensor (float16/bfloat16/float32/float64), got "
         "dtype torch.float8_e4m3fn"),
    Case("orthogonalize-steps-huge", "`orthogonalize(G, steps=10**9)`",
         lambda: _orthogonalize(torch.randn(4, 6), steps=10**9), ValueError,
         "steps must be at most 100"),
    Case("plan-ilp-gap-negative", "`plan_owners(items, 2, strategy='ilp', ilp_gap=-1)`",
         lambda: _plan(strategy="ilp", ilp_gap=-1.0), ValueError,
         "ilp_gap must be a relative gap ≥ 0"),
    Case("plan-spread-layers-string", "`plan_owners(items, 2, spread_layers='no')`",
         lambda: _plan(spread_layers="no"), ValueError,
         "spread_layers must be True or False, got 'no'"),
    Case("plan-cost-none", "`plan_owners(items, 2, cost=lambda item: None)`",
         lambda: _plan(cost=lambda item: None), ValueError,
         "cost: the cost function must return a number"),
    Case("plan-cost-string", "`plan_owners(items, 2, cost={'a': '1', ...})`",
         lambda: _plan(cost={"a": "1", "b": 1.0}), ValueError,
         "cost: the mapping's costs must be numbers"),
    Case("plan-held-none", "`plan_owners(items, 2, held=[None, []])`",
         lambda: _plan(held=[None, []]), ValueError,
         "held[0] must be a list of the MatrixItems rank 0 steps"),
    Case("matrix-item-complex", "`MatrixItem('w', (4, 6), torch.complex64)`",
         lambda: _matrix_item("w", (4, 6), torch.complex64), ValueError,
         "dtype must be a torch.dtype or one of"),
    Case("matrix-item-shape-none", "`MatrixItem('w', None)`",
         lambda: _matrix_item("w", None), ValueError,
         "item 'w': shape must be (m, n) or (*batch, m, n) of ints ≥ 0, got None"),
    Case("qk-clip-max-elements", "`QKClip(model, max_elements=1.5)`",
         lambda: _qk_clip(max_elements=1.5), ValueError,
         "max_elements must be a positive int"),
]  # fmt: skip


def test_the_table_has_at_least_twenty_distinct_rows():
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [c for c in CASES if c.ranks == 1], ids=lambda c: c.id)
def test_a_wrong_input_gives_its_clear_error(case):
    with pytest.raises(case.error) as info:
        case.run()
    assert case.says in str(info.value), str(info.value)


def run_multi(rank: int, world: int, ids: list[str]) -> dict[str, tuple[str, str]]:
    out = {}
    for case in CASES:
        if case.id not in ids:
            continue
        try:
            case.run(rank, world)
            out[case.id] = ("", "no error")
        except Exception as err:  # every rank reports what it raised
            out[case.id] = (type(err).__name__, str(err))
    return out


def test_wrong_distributed_inputs_raise_on_every_rank():
    from dmuon.comm.testing import run_on_ranks

    multi = [c for c in CASES if c.ranks == 2]
    results = run_on_ranks(run_multi, 2, args=([c.id for c in multi],), timeout=120)
    for rank, got in enumerate(results):
        for case in multi:
            kind, text = got[case.id]
            assert kind == case.error.__name__, f"{case.id}, rank {rank}: {kind}: {text}"
            assert case.says in text, f"{case.id}, rank {rank}: {text}"


def table() -> str:
    """The Markdown table of ``CASES`` for docs/troubleshooting.md."""
    lines = ["| Wrong input | Error | The message says |", "|---|---|---|"]
    for c in CASES:
        assert "|" not in c.says and "`" not in c.says, c.id  # a code span in a table cell
        where = " (every rank)" if c.ranks > 1 else ""
        lines.append(f"| {c.wrong} | `{c.error.__name__}`{where} | `{c.says}` |")
    return "\n".join(lines)


def test_the_troubleshooting_page_lists_the_table():
    text = PAGE.read_text()
    m = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert m, f"{PAGE.name} lacks the markers {BEGIN} … {END}"
    assert m.group(1).strip() == table(), (
        "docs/troubleshooting.md's table differs from CASES; "
        "run: python tests-integration/test_bad_config.py"
    )


if __name__ == "__main__":  # rewrite the page's table from CASES
    text = PAGE.read_text()
    new = re.sub(
        re.escape(BEGIN) + r"\n.*?" + re.escape(END),
        lambda _: f"{BEGIN}\n{table()}\n{END}",
        text,
        flags=re.S,
    )
    PAGE.write_text(new)
    sys.exit(0)
