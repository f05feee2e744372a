"""load_model reads single-file and sharded safetensors folders and explains what is wrong."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from raypaged.model.loader import checkpoint_files, load_model, resolve_dtype

TINY = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY).eval()


def assert_same_weights(ours, hf):
    sd = hf.state_dict()
    q, k, v = (sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(ours.layers[0].mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(ours.lm_head.weight, sd["lm_head.weight"])
    assert torch.equal(ours.norm.weight, sd["model.norm.weight"])


def test_loads_single_file(tmp_path, tiny_hf):
    tiny_hf.save_pretrained(tmp_path)
    assert [p.name for p in checkpoint_files(tmp_path)] == ["model.safetensors"]
    ours, config = load_model(tmp_path, dtype="float32")
    assert config.num_layers == 2 and not ours.training
    assert_same_weights(ours, tiny_hf)


def test_loads_sharded_checkpoint_through_its_index(tmp_path, tiny_hf):
    tiny_hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    # A stray file the index does not name (like Mistral's consolidated copy) is not read.
    (tmp_path / "consolidated.safetensors").write_bytes(b"not a checkpoint")
    assert [p.name for p in checkpoint_files(tmp_path)] == shards
    ours, _ = load_model(tmp_path, dtype="float32")
    assert_same_weights(ours, tiny_hf)


def test_bfloat16_load_casts_every_parameter(tmp_path, tiny_hf):
    tiny_hf.save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}


def test_auto_dtype_is_bfloat16_on_cuda_and_on_cpus_with_native_bf16_else_float32(monkeypatch):
    import raypaged.model.loader as loader

    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16


def test_unknown_dtype_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown dtype 'fp64'; choices: auto, float32, bfloat16, float16"):
        resolve_dtype("fp64", "cpu")


def test_unknown_architecture_is_refused(tmp_path, tiny_hf):
    tiny_hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, architectures=["PhiForCausalLM"])))
    with pytest.raises(ValueError, match=r"found \['PhiForCausalLM'\]; supported: LlamaForCausalLM"):
        load_model(tmp_path)


def test_missing_folder_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model folder {missing} does not exist"):
        load_model(missing)


def test_folder_without_safetensors_says_what_it_found(tmp_path, tiny_hf):
    tiny_hf.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError,
                       match=r"no \*.safetensors weights in .*\['config.json', 'pytorch_model.bin'\]"):
        load_model(tmp_path)


def test_index_naming_a_missing_shard_is_an_error(tmp_path, tiny_hf):
    tiny_hf.save_pretrained(tmp_path, max_shard_size="20KB")
    first = sorted(tmp_path.glob("model-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(FileNotFoundError, match=f"names shards that are not in .*{first.name}"):
        load_model(tmp_path)


def test_checkpoint_missing_a_tensor_is_an_error(tmp_path, tiny_hf):
    from safetensors.torch import save_file
    tiny_hf.config.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in tiny_hf.state_dict().items()
          if k != "model.layers.1.self_attn.v_proj.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. \['layers.1.self_attn.qkv_proj.weight \(v_proj\)'\]"):
        load_model(tmp_path)
