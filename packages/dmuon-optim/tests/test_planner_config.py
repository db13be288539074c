"""Model configurations → Muon matrices and scalars, checked against published counts."""

import json
import pathlib

import pytest
import torch

from dmuon.optim import param_groups
from dmuon.optim.planner.config import (
    PRESETS,
    ConfigError,
    load_model,
    spec_from_hf_config,
    spec_from_module,
)

CONFIGS = pathlib.Path(__file__).parent / "planner_configs"

# Parameter counts published for each model (Hugging Face model cards / safetensors
# metadata "Model size" and the papers): an independent reference for the parser.
PUBLISHED = {
    "gpt2": 124_439_808,  # GPT-2 small, safetensors metadata
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b-v0.1": 7_241_732_096,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "mixtral-8x7b-v0.1": 46_702_792_704,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen3-30b-a3b": 30_532_122_624,
}
# Active parameters per token as the model cards state them (B, rounded by the authors:
# Qwen3-30B-A3B's card says 3.3B for 3.35B counting both embedding matrices).
ACTIVE = {"mixtral-8x7b-v0.1": 12.9, "qwen1.5-moe-a2.7b": 2.7, "qwen3-30b-a3b": 3.3}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_json_gives_the_published_parameter_count(name):
    spec = load_model(str(CONFIGS / f"{name}.json"))
    assert spec.name == name
    assert spec.total_params == PUBLISHED[name]
    if name in ACTIVE:
        assert abs(spec.active_params / 1e9 - ACTIVE[name]) < 0.06
    else:
        assert spec.active_params == spec.total_params


def test_every_preset_matches_its_config_file():
    files = {p.stem.removesuffix("-v0.1"): p for p in CONFIGS.glob("*.json")}
    assert set(PRESETS) == set(files)
    for name in PRESETS:
        a, b = load_model(name), load_model(str(files[name]))
        assert [(i.name, i.shape, i.layer) for i in a.matrices] == [
            (i.name, i.shape, i.layer) for i in b.matrices
        ]
        assert a.scalars == b.scalars


def test_llama_matrix_shapes_and_scalars():
    spec = load_model("llama-3.1-8b")
    by_name = {i.name: i.shape for i in spec.matrices}
    p = "model.layers.7"
    assert by_name[f"{p}.self_attn.q_proj.weight"] == (4096, 4096)
    assert by_name[f"{p}.self_attn.k_proj.weight"] == (1024, 4096)  # 8 kv heads × 128
    assert by_name[f"{p}.self_attn.o_proj.weight"] == (4096, 4096)
    assert by_name[f"{p}.mlp.gate_proj.weight"] == (14336, 4096)
    assert by_name[f"{p}.mlp.down_proj.weight"] == (4096, 14336)
    assert len(spec.matrices) == 7 * 32 and len(spec.layers) == 32
    scalars = dict(spec.scalars)  # embeddings and the untied head go to AdamW
    assert scalars["model.embed_tokens.weight"] == scalars["lm_head.weight"] == 128256 * 4096
    assert {i.layer for i in spec.matrices if i.name.startswith(p + ".")} == {p}


def test_qwen_biases_qk_norms_and_tied_heads():
    q2 = dict(load_model("qwen2.5-1.5b").scalars)
    assert q2["model.layers.0.self_attn.k_proj.bias"] == 2 * 128 and "lm_head.weight" not in q2
    q3 = dict(load_model("qwen3-8b").scalars)
    assert q3["model.layers.0.self_attn.q_norm.weight"] == 128
    assert "model.layers.0.self_attn.q_proj.bias" not in q3


def test_gpt2_fused_attention_and_moe_expert_stacks():
    g = {i.name: i.shape for i in load_model("gpt2").matrices}
    assert g["transformer.h.0.attn.c_attn.weight"] == (768, 2304)  # Conv1D: (in, out)
    mix = {i.name: i.shape for i in load_model("mixtral-8x7b").matrices}
    assert mix["model.layers.0.block_sparse_moe.experts.up_proj"] == (8, 14336, 4096)
    assert mix["model.layers.0.block_sparse_moe.gate.weight"] == (8, 4096)
    q = {i.name: i.shape for i in load_model("qwen1.5-moe-a2.7b").matrices}
    assert q["model.layers.3.mlp.experts.down_proj"] == (60, 2048, 1408)
    assert q["model.layers.3.mlp.shared_expert.up_proj.weight"] == (5632, 2048)


def test_dtype_is_what_is_communicated():
    spec = load_model("gpt2", dtype=torch.float32)
    assert {i.dtype for i in spec.matrices} == {torch.float32}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be an integer ≥ 1, got 0"),
        ({"vocab_size": "big"}, "'vocab_size' must be an integer"),
        ({"model_type": "bert"}, "field 'model_type' must be one of"),
        ({"tie_word_embeddings": "yes"}, None),
    ],
)
def test_a_bad_config_names_the_field(tmp_path, change, field):
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    for k, v in change.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    if field is None:  # a truthy string is read as true: tied head, no lm_head
        assert "lm_head.weight" not in dict(load_model(str(path)).scalars)
        return
    with pytest.raises(ConfigError, match=field):
        load_model(str(path))


@pytest.mark.parametrize(
    ("preset", "change", "message"),
    [
        ("llama-3.1-8b", {"num_attention_heads": 24}, r"'hidden_size' \(4096\) must be a multiple "
         r"of 'num_attention_heads' \(24\)"),
        ("llama-3.1-8b", {"num_key_value_heads": 5}, r"'num_attention_heads' \(32\) must be a "
         r"multiple of 'num_key_value_heads' \(5\)"),
        ("gpt2", {"n_head": 5}, r"'n_embd' \(768\) must be a multiple of 'n_head' \(5\)"),
    ],
)  # fmt: skip
def test_heads_that_do_not_divide_are_refused(preset, change, message):
    cfg = {**PRESETS[preset], **change}
    with pytest.raises(ConfigError, match=message):
        spec_from_hf_config(cfg, name=preset)


def test_an_explicit_head_dim_frees_the_heads_from_hidden_size():
    # 24 heads of 128 (3072 wide) on hidden_size 4096, not a multiple of 24: legal with head_dim
    cfg = {**PRESETS["qwen3-8b"], "num_attention_heads": 24, "num_key_value_heads": 8}
    assert cfg.get("head_dim") == 128
    spec = spec_from_hf_config(cfg, name="qwen3")
    q = next(i for i in spec.matrices if i.name.endswith("q_proj.weight"))
    assert q.shape == (24 * 128, cfg["hidden_size"])


def test_moe_config_without_expert_count_names_it():
    cfg = dict(PRESETS["mixtral-8x7b"])
    del cfg["num_local_experts"]
    with pytest.raises(ConfigError, match="'num_local_experts' is missing"):
        spec_from_hf_config(cfg, name="mixtral")


def test_unknown_model_unreadable_file_and_directory(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model("llama-9")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(str(tmp_path))  # a directory: its config.json
    with pytest.raises(ConfigError, match="no file"):
        load_model(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        spec_from_hf_config([1, 2])  # type: ignore[arg-type]


def test_module_factory_is_built_on_meta_and_split_like_param_groups():
    import planner_factories

    planner_factories.BUILT_ON.clear()
    spec = load_model("planner_factories:tiny")
    assert planner_factories.BUILT_ON == ["meta"]
    # reference: param_groups on a real CPU instance
    model = planner_factories.tiny()
    groups = param_groups(model)
    matrices = {
        n: tuple(p.shape)
        for g in groups
        if g.get("rule") != "scalar"
        for n, p in zip(g["param_names"], g["params"], strict=True)
    }
    assert {i.name: i.shape for i in spec.matrices} == matrices
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    assert dict(spec.scalars)["head.weight"] == 50 * 16  # the head goes to AdamW


def test_module_factory_errors_name_the_target():
    with pytest.raises(ConfigError, match="cannot import 'nope' from module 'planner_factories'"):
        load_model("planner_factories:nope")
    with pytest.raises(ConfigError, match=r"returned int, not an nn\.Module"):
        load_model("planner_factories:not_a_module")


def test_spec_from_module_counts_a_plain_model():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    spec = spec_from_module(m)
    assert spec.matrix_params == 8 * 16 + 16 * 4 and spec.scalar_params == 16 + 4
