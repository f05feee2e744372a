"""ModelConfig reads the fields we compute with, and refuses what we would compute wrongly."""
from __future__ import annotations

import json

import pytest

from raypaged.model.model_config import ModelConfig, RopeScaling

SMOLLM2_135M = {  # SmolLM2-135M-Instruct's config.json (the fields that matter)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}


def test_smollm2_config_fields():
    cfg = ModelConfig.from_dict(SMOLLM2_135M)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM", 49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling) == (1e-5, 100000.0, None)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.o_proj_bias
    assert (cfg.eos_token_ids, cfg.bos_token_id) == ((2,), 1)
    assert cfg.max_model_len == 8192


def test_llama3_rope_scaling_in_both_transformers_4_and_5_layouts():
    v4 = dict(SMOLLM2_135M, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    v5 = {k: v for k, v in SMOLLM2_135M.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}
    want = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    for raw in (v4, v5):
        cfg = ModelConfig.from_dict(raw)
        assert (cfg.rope_theta, cfg.rope_scaling) == (500000.0, want)


def test_linear_rope_scaling_with_old_type_key():
    cfg = ModelConfig.from_dict(dict(SMOLLM2_135M, rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling == RopeScaling("linear", 2.0)


def test_unsupported_rope_scaling_is_refused_by_name():
    with pytest.raises(ValueError, match="'yarn' is not supported; supported: llama3, linear"):
        ModelConfig.from_dict(dict(SMOLLM2_135M, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_qwen2_has_qkv_bias_but_no_o_proj_bias_and_ignores_unused_sliding_window():
    qwen = dict(SMOLLM2_135M, architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                use_sliding_window=False, max_position_embeddings=32768)
    cfg = ModelConfig.from_dict(qwen)
    assert cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.sliding_window is None and cfg.max_model_len == 32768


def test_llama_attention_bias_covers_o_proj_too():
    cfg = ModelConfig.from_dict(dict(SMOLLM2_135M, attention_bias=True))
    assert cfg.attention_bias and cfg.o_proj_bias


def test_mistral_sliding_window_caps_max_model_len():
    raw = dict(SMOLLM2_135M, architectures=["MistralForCausalLM"], sliding_window=4096,
               max_position_embeddings=32768, head_dim=128)
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.sliding_window, cfg.max_model_len, cfg.head_dim) == (4096, 4096, 128)
    assert ModelConfig.from_dict(dict(raw, sliding_window=None)).max_model_len == 32768


def test_head_dim_defaults_to_hidden_over_heads_when_null():
    assert ModelConfig.from_dict(dict(SMOLLM2_135M, head_dim=None)).head_dim == 64


def test_architecture_from_model_type_when_architectures_is_absent():
    raw = {k: v for k, v in SMOLLM2_135M.items() if k != "architectures"}
    assert ModelConfig.from_dict(dict(raw, model_type="qwen2")).architecture == "Qwen2ForCausalLM"


def test_unsupported_architecture_names_what_was_found_and_what_is_supported():
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(dict(SMOLLM2_135M, architectures=["GPT2LMHeadModel"]))
    assert str(err.value) == ("unsupported model architecture: found ['GPT2LMHeadModel']; "
                              "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM")


def test_other_activation_is_refused():
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict(dict(SMOLLM2_135M, hidden_act="gelu"))


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(SMOLLM2_135M, eos_token_id=[128001, 128008])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (128001, 128008, 128009)


def test_missing_config_json_lists_what_the_folder_holds(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no config.json in .*found \['model.safetensors'\]"):
        ModelConfig.from_dir(tmp_path)
