"""DMuon in torchtitan: ``DMuonOptimizersContainer`` on torchtitan's parallel layout.

torchtitan parallelises a model with ``parallelize_module`` on the ``tp`` mesh
dimension and FSDP2's ``fully_shard`` on ``dp``, then builds its optimizer container
from the model part. Its trainer needs CUDA (flex attention has no CPU backward, its
meshes are built for ``cuda``), so the trainer itself is not run here; what runs on
CPU is:

* the container built on a model with torchtitan's layout and FQNs (token
  embedding, fused ``wqkv``, SwiGLU ``w1/w2/w3``, RMSNorms, ``lm_head``), the
  feed-forward split over ``tp`` and every layer sharded by FSDP2 over ``dp``, on
  4 gloo ranks (dp 2 × tp 2): three steps clipped by the container's
  ``clip_grad_norm_`` equal one process clipped by its ``max_norm``;
* a DCP round trip through the container, as torchtitan's checkpointer does it (the
  container is a ``Stateful`` in the state dict): saved on dp 2 × tp 2, loaded on
  plain FSDP2 at world 2, the next step equals one process's;
* the container built on torchtitan's own Llama 3 debug model (groups, state keys);
* the errors for keys DMuon does not accept, and the ``fused``/``foreach`` keys
  torchtitan adds to every group dropped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensor_parallel_cases import error
from torch import nn
from torchtitan.components.optimizer import ParamGroupConfig

from dmuon.comm.testing import run_on_ranks
from dmuon.integrations.torchtitan import DMuonOptimizersContainer, dmuon_optimizer

D, VOCAB, SEQ, BATCH, STEPS, CLIP = 16, 32, 8, 4, 3, 0.5
SPLIT = {r"wqkv\.weight$": [D, D, D]}
OPT = dict(lr=0.02, weight_decay=0.01, momentum=0.9, ns_compute_dtype=torch.float32)
# sharded over dp 2 × tp 2 (Gram Newton–Schulz on the tp shards) against the whole
# matrices in one process: fp32 rounding apart, 1e-6 as in test_fsdp_tensor_parallel.
TOLERANCE = 1e-6


class Block(nn.Module):
    """One torchtitan Llama 3 block's parameters, by torchtitan's names."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(D)
        self.attention = nn.Module()
        self.attention.wqkv = nn.Linear(D, 3 * D, bias=False)
        self.attention.wo = nn.Linear(D, D, bias=False)
        self.ffn_norm = nn.RMSNorm(D)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(D, 2 * D, bias=False)
        self.feed_forward.w2 = nn.Linear(2 * D, D, bias=False)
        self.feed_forward.w3 = nn.Linear(D, 2 * D, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.attention
        q, k, v = a.wqkv(self.attention_norm(h)).split(D, dim=-1)
        heads = [t.unflatten(-1, (2, D // 2)).transpose(1, 2) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).flatten(2)
        h = h + a.wo(o)
        f = self.feed_forward
        x = self.ffn_norm(h)
        return h + f.w2(F.silu(f.w1(x)) * f.w3(x))


class TitanShaped(nn.Module):
    """A two-block decoder laid out like torchtitan's ``Llama3Model``."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            self.tok_embeddings = nn.Embedding(VOCAB, D)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
            self.norm = nn.RMSNorm(D)
            self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())


def parallelize(model: TitanShaped, mesh, tp: bool) -> TitanShaped:
    """torchtitan's order: tensor parallel on ``tp`` (the feed-forward), then FSDP2 on ``dp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if tp:
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        for layer in model.layers.values():
            parallelize_module(layer.feed_forward, mesh["tp"], plan)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def train(model, container, steps, rows=slice(None)):
    norms = []
    for t in steps:
        tokens, labels = batch(t)
        loss_of(model, tokens[rows], labels[rows]).backward()
        norms.append(float(container.clip_grad_norm_(CLIP)))
        container.step()
        container.zero_grad()
    return norms


def one_process(loss=loss_of) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference, clipped by the container's own ``max_norm`` in ``step``; ``loss``:
    ``(model, tokens, labels) → loss`` over the whole global batch."""
    model = TitanShaped()
    config = dmuon_optimizer(mode="single", split_sizes=SPLIT, **OPT)
    config.max_norm = CLIP
    container = config.build(model_parts=[model])
    norms = []
    for t in range(STEPS):
        loss(model, *batch(t)).backward()
        container.step()
        container.zero_grad()
        norms.append(float(container.last_grad_norm))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def whole(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def patterned() -> DMuonOptimizersContainer.Config:
    """torchtitan-style patterns, the catch-all last (torchtitan adds ``foreach`` to each)."""
    return DMuonOptimizersContainer.Config(
        implementation="foreach",
        param_groups=[
            ParamGroupConfig(
                pattern=r"wqkv\.weight$",
                optimizer_name="DMuon",
                optimizer_kwargs={"split_sizes": [D, D, D]},
            ),
            ParamGroupConfig(
                pattern=r"(embeddings|lm_head|norm)",
                optimizer_name="DMuon",
                optimizer_kwargs={"rule": "scalar", "lr": OPT["lr"]},
            ),
            ParamGroupConfig(pattern=r".*", optimizer_name="DMuon"),
        ],
        dmuon={**OPT, "tp_path": "gram"},
    )


def run_save(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = slice(2 * mesh.get_coordinate()[0], 2 * mesh.get_coordinate()[0] + 2)
    model = parallelize(TitanShaped(), mesh, tp=True)
    container = patterned().build(model_parts=[model])
    keys = sorted({k for g in container.dmuon.param_groups for k in g})
    norms = train(model, container, range(STEPS - 1), rows)
    # torchtitan's checkpointer: the container is a Stateful beside the model's tensors
    dcp.save({"model": get_model_state_dict(model), "optimizer": container}, checkpoint_id=path)
    norms += train(model, container, [STEPS - 1], rows)
    placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
    return container.dmuon.engine.mode, whole(model), norms, keys, placements


def run_load(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = parallelize(TitanShaped(), {"dp": mesh}, tp=False)
    container = patterned().build(model_parts=[model])
    state = {"model": get_model_state_dict(model), "optimizer": container}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    rows = slice(2 * rank, 2 * rank + 2)
    norms = train(model, container, [STEPS - 1], rows)
    return container.dmuon.engine.mode, whole(model), norms


def test_container_on_fsdp2_over_tensor_parallel_equals_one_process_and_reshards(tmp_path):
    expected, norms = one_process()
    assert min(norms) > CLIP, f"clipping never engaged: {norms}"
    path = str(tmp_path / "step-2")
    saved = run_on_ranks(run_save, 4, args=(path,), timeout=120)
    loaded = run_on_ranks(run_load, 2, args=(path,), timeout=120)
    place = saved[0][4]
    assert place["layers.0.feed_forward.w1.weight"].count("Shard") == 2, place  # dp and tp
    for rank, (mode, got, got_norms, keys, _) in enumerate(saved):
        assert mode == "sharded", (rank, mode)
        assert not {"fused", "foreach"} & set(keys), keys
        for a, b in zip(got_norms, norms, strict=True):
            assert abs(a - b) <= 1e-5 * b, f"rank {rank}: norm {a} vs {b}"
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"dp×tp rank {rank}: {name} differs by {diff:.2e}"
    for rank, (mode, got, got_norms) in enumerate(loaded):
        assert mode == "sharded", (rank, mode)
        assert abs(got_norms[0] - norms[-1]) <= 1e-5 * norms[-1], (rank, got_norms, norms)
        for name, want in expected.items():
            diff = (got[name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"resumed rank {rank}: {name} differs by {diff:.2e}"


def test_container_on_torchtitans_llama3_debug_model():
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:2]
    model = config.build()
    container = dmuon_optimizer(mode="single").build(model_parts=[model])
    groups = {
        n: g.get("rule", "muon") for g in container.dmuon.param_groups for n in g["param_names"]
    }
    assert groups["tok_embeddings.weight"] == "adamw"
    assert groups["lm_head.weight"] == "adamw"
    assert groups["norm.weight"] == "adamw"
    assert groups["layers.0.attention.qkv_linear.wqkv.weight"] == "muon"
    assert groups["layers.1.feed_forward.w2.weight"] == "muon"
    split = {
        n: g.get("split_sizes") for g in container.dmuon.param_groups for n in g["param_names"]
    }
    # orthogonalised whole: torchtitan's fused wqkv interleaves q, k, v per kv head
    assert not split["layers.1.attention.qkv_linear.wqkv.weight"]
    state = container.state_dict()
    assert set(state["state"]) == set(groups), sorted(set(groups) ^ set(state["state"]))
    assert sorted(state["state"]["layers.0.feed_forward.w1.weight"]) == [
        "momentum_buffer",
        "step",
    ]
    container.load_state_dict(state)


def test_bad_torchtitan_config_keys_are_named():
    model = TitanShaped()

    def build(**config):
        return lambda: DMuonOptimizersContainer.Config(mode="single", **config).build(
            model_parts=[model]
        )

    assert "'fused'" in error(build(dmuon={"fused": True}))
    assert "'bogus'" in error(build(dmuon={"bogus": 1}))
    assert "'params'" in error(build(dmuon={"params": []}))
    other = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={})]
    message = error(build(param_groups=other))
    assert "'AdamW'" in message and "param_groups[0]" in message, message
    typo = [ParamGroupConfig(pattern=".*", optimizer_name="DMuon", optimizer_kwargs={"lrr": 1})]
    assert "'lrr'" in error(build(param_groups=typo))
    assert "max_norm" in error(build(max_norm=0.0))
    container = DMuonOptimizersContainer.Config(mode="single").build(model_parts=[model])
    assert "closure" in error(lambda: container.step(lambda: 0.0))
    assert "model_parts" in error(
        lambda: DMuonOptimizersContainer.Config().build(model_parts=[model, model])
    )


# --- owner mode: parallelize_for_owners (the model spec's parallelize_fn) + the container


class Dims:
    """torchtitan's ``ParallelDims`` as ``parallelize_for_owners`` reads it. The real one
    cannot build meshes here: torchtitan picks ``cuda`` as its device type when no
    accelerator is present, so the meshes are built on CPU by the test."""

    cp_enabled = pp_enabled = ep_enabled = dp_replicate_enabled = False
    dp_enabled = dp_shard_enabled = True

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.tp_enabled = "tp" in mesh.mesh_dim_names

    def get_mesh(self, dims):
        names = {"fsdp": "dp", "batch": "dp"}
        dims = [dims] if isinstance(dims, str) else dims
        return self.mesh[tuple(names.get(d, d) for d in dims)]


class TitanTP(TitanShaped):
    def parallelize(self, parallel_dims) -> None:
        """What torchtitan's model does on ``tp``: the feed-forward split (as ``parallelize``)."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        for layer in self.layers.values():
            parallelize_module(layer.feed_forward, parallel_dims.get_mesh("tp"), plan)


def titan_configs(**training):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    owner = dict(mixed_precision_param="float32", max_norm=float("inf"), disable_cuda_graphs=True)
    return dict(
        training=TrainingConfig(**{**owner, **training}),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(),
    )


def owner_model(mesh, micro=1, ac=None):
    """torchtitan's order: built on meta, parallelised, materialised, initialised; ``micro``
    micro-batches per step (torchtitan's global batch over its local batch × dp); ``ac``:
    torchtitan's activation checkpointing of every block (``"full"``, ``"selective"``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor

    from dmuon.integrations.torchtitan import parallelize_for_owners

    reference = TitanShaped().state_dict()
    with torch.device("meta"):
        model = TitanTP()
    batches = dict(local_batch_size=2 // micro, global_batch_size=BATCH)
    ac_config = None
    if ac is not None:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        ac_config = {"full": FullAC, "selective": SelectiveAC}[ac].Config()
    parallelize_for_owners(
        model, parallel_dims=Dims(mesh), ac_config=ac_config, **titan_configs(**batches)
    )
    # FSDP2's gradient division off (torchtitan's) is a PREMUL_SUM reduction gloo does not
    # have; a plain sum is the same (as test_torchtitan_ep.py does)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():  # init_weights: the reference's values
        for name, p in model.named_parameters():
            value = reference[unwrapped(name)]
            if isinstance(p, DTensor):
                value = distribute_tensor(value, p.device_mesh, p.placements)
            p.copy_(value)
    return model


def unwrapped(name: str) -> str:
    """A parameter's name without the checkpoint wrapper's level (activation checkpointing)."""
    return name.replace("._checkpoint_wrapped_module", "")


def owner_container(model):
    config = dmuon_optimizer(mode="owner", split_sizes=SPLIT, **OPT)
    config.max_norm = CLIP
    return config.build(model_parts=[model])


def titan_loss(model, tokens, labels, global_tokens):
    """torchtitan's loss: this rank's token sum over the global token count."""
    logits = model(tokens).flatten(0, 1).float()
    return F.cross_entropy(logits, labels.flatten(), reduction="sum") / global_tokens


def owner_train(model, container, steps, rows, micro=1):
    norms, leftover = [], []
    for t in steps:
        tokens, labels = batch(t)
        tokens, labels = tokens[rows], labels[rows]
        step = len(tokens) // micro
        for m in range(0, len(tokens), step):  # torchtitan's micro-batches, no no_sync
            mine = slice(m, m + step)
            titan_loss(model, tokens[mine], labels[mine], BATCH * SEQ).backward()
        # torchtitan's trainer takes the norm of every p.grad before the step: only
        # FSDP2's DTensor gradients may be there (a plain one beside them would raise)
        leftover += [
            n
            for n, p in model.named_parameters()
            if p.grad is not None and not isinstance(p.grad, torch.distributed.tensor.DTensor)
        ]
        container.step()
        container.zero_grad()
        norms.append(float(container.last_grad_norm))
    return norms, leftover


def run_owner(rank, world, path, micro=1, ac=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = ((2, 2), ("dp", "tp")) if world == 4 else ((2,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = mesh.get_coordinate()[0]
    rows = slice(2 * dp, 2 * dp + 2)
    model = owner_model(mesh, micro, ac)
    container = owner_container(model)
    owners = sorted(set(container.dmuon.engine.describe().get("owners", {}).values()))
    norms, leftover = owner_train(model, container, range(STEPS - 1), rows, micro)
    out = {"mode": container.dmuon.engine.mode, "leftover": leftover, "owners": owners}
    if path is not None:  # torchtitan's checkpointer: model tensors + the container
        dcp.save({"model": get_model_state_dict(model), "optimizer": container}, checkpoint_id=path)
    more, _ = owner_train(model, container, [STEPS - 1], rows, micro)
    container.dedication.wait()  # the last step's weights, published, land on every rank
    out.update(norms=norms + more, weights=whole(model))
    if path is not None:  # a fresh model and container, loaded, take the last step again
        model = owner_model(mesh)
        container = owner_container(model)
        state = {"model": get_model_state_dict(model), "optimizer": container}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        again, _ = owner_train(model, container, [STEPS - 1], rows)
        container.dedication.wait()
        out.update(resumed_norm=again[0], resumed=whole(model))
    return out


def one_process_titan_loss() -> tuple[dict[str, torch.Tensor], list[float]]:
    return one_process(
        lambda model, tokens, labels: titan_loss(model, tokens, labels, labels.numel())
    )


def check_owner_run(results, expected, norms):
    for rank, out in enumerate(results):
        assert out["mode"] == "owner", (rank, out["mode"])
        assert not out["leftover"], f"rank {rank}: plain gradients after backward {out['leftover']}"
        for a, b in zip(out["norms"], norms, strict=True):
            assert abs(a - b) <= 1e-5 * b, f"rank {rank}: norm {a} vs {b}"
        for name, want in expected.items():
            diff = (out["weights"][name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank}: {name} differs by {diff:.2e}"


def test_owner_mode_in_torchtitan_equals_one_process_and_round_trips_through_dcp(tmp_path):
    expected, norms = one_process_titan_loss()
    assert min(norms) > CLIP, f"clipping never engaged: {norms}"
    results = run_on_ranks(run_owner, 2, args=(str(tmp_path / "owner"),), timeout=120)
    check_owner_run(results, expected, norms)
    for rank, out in enumerate(results):
        assert abs(out["resumed_norm"] - norms[-1]) <= 1e-5 * norms[-1], (rank, out)
        for name, want in out["weights"].items():
            diff = (out["resumed"][name] - want).abs().max().item()
            assert diff <= TOLERANCE, f"resumed rank {rank}: {name} differs by {diff:.2e}"


def test_owner_mode_in_torchtitan_with_gradient_accumulation_equals_one_process():
    expected, norms = one_process_titan_loss()
    results = run_on_ranks(run_owner, 2, args=(None, 2), timeout=120)
    check_owner_run(results, expected, norms)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_owner_mode_in_torchtitan_with_activation_checkpointing_equals_one_process(ac):
    """Each block recomputed in backward (torchtitan's checkpoint wrapper around each block:
    the dedicated matrices are renamed under ``_checkpoint_wrapped_module``; the layer's
    forward pre-hook sits on the wrapper, so the recomputation inside it does not wait
    again) steps as one process does."""
    expected, norms = one_process_titan_loss()
    results = run_on_ranks(run_owner, 2, args=(None, 1, ac), timeout=120)
    for out in results:
        names = list(out["weights"])
        assert any("_checkpoint_wrapped_module" in n for n in names), names[:4]
        out["weights"] = {unwrapped(n): w for n, w in out["weights"].items()}
    check_owner_run(results, expected, norms)


def test_owner_mode_in_torchtitan_over_tensor_parallel_equals_one_process():
    expected, norms = one_process_titan_loss()
    results = run_on_ranks(run_owner, 4, args=(None,), timeout=120)
    check_owner_run(results, expected, norms)


def test_owner_mode_settings_it_does_not_take_are_named():
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    from dmuon.integrations.torchtitan import parallelize_for_owners

    class Bad(Dims):
        def __init__(self, **flags) -> None:
            self.tp_enabled = False
            self.__dict__.update(flags)

    def parallelize(dims=None, **configs):
        settings = {**titan_configs(), **configs}
        return lambda: parallelize_for_owners(
            TitanShaped(), parallel_dims=dims or Bad(), **settings
        )

    bf16 = TrainingConfig(disable_cuda_graphs=True, max_norm=float("inf"))  # default: bf16
    assert "mixed_precision_param='bfloat16'" in error(parallelize(training=bf16))
    backend = ParallelismConfig()  # torchtitan's default backend
    assert "spmd_backend='spmd_types'" in error(parallelize(parallelism=backend))
    compiled = CompileConfig(enable=True)
    assert "compile.enable" in error(parallelize(compile_config=compiled))
    assert "context parallelism" in error(parallelize(Bad(cp_enabled=True)))
    assert "expert parallelism" in error(parallelize(Bad(ep_enabled=True)))
    hsdp_tp = Bad(tp_enabled=True, dp_replicate_enabled=True)
    assert "HSDP" in error(parallelize(hsdp_tp))
    one_shard = Bad(dp_replicate_enabled=True, dp_shard_enabled=False)
    assert "data_parallel_shard_degree 1" in error(parallelize(one_shard))
    graphs = TrainingConfig(mixed_precision_param="float32", max_norm=float("inf"))
    assert "disable_cuda_graphs=False" in error(parallelize(training=graphs))
    clip = TrainingConfig(mixed_precision_param="float32", disable_cuda_graphs=True)
    assert "training.max_norm=1" in error(parallelize(training=clip))
    offload = TrainingConfig(
        mixed_precision_param="float32",
        disable_cuda_graphs=True,
        max_norm=float("inf"),
        enable_cpu_offload=True,
    )
    assert "enable_cpu_offload" in error(parallelize(training=offload))
    # the container in owner mode on a model parallelise_for_owners never saw
    message = error(lambda: dmuon_optimizer(mode="owner").build(model_parts=[TitanShaped()]))
    assert "parallelize_for_owners" in message, message
