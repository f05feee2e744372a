"""Load a local Hugging Face folder (config.json + safetensors, sharded or not) into our LlamaModel.

Weights go straight from the safetensors files into our own module (no transformers model is
built): the model is created on the meta device in the target dtype, materialised once on the
target device with to_empty(), and every parameter is then filled from the checkpoint, so no
memory is spent on random initialisation or on a second copy in another dtype.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from raypaged.config import DTYPE_CHOICES
from raypaged.model.attention import AttentionBackend, get_attention_backend
from raypaged.model.llama import LlamaModel
from raypaged.model.model_config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 / AMX: bf16 matmuls faster than fp32 (benchmarks/offline_throughput.py);
    without them bf16 is emulated and slower than fp32."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype_name(dtype: str, device: torch.device | str) -> str:
    """The one "auto" rule: bf16 on a GPU; on a CPU bf16 where it has native bf16 matmuls, else
    fp32. Other names are checked and returned as they are."""
    if dtype == "auto":
        bf16 = torch.device(device).type == "cuda" or cpu_has_native_bf16()
        return "bfloat16" if bf16 else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choices: {', '.join(DTYPE_CHOICES)}")
    return dtype


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    return DTYPES[resolve_dtype_name(dtype, device)]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the model: those named by model.safetensors.index.json when
    present, else every *.safetensors except Mistral's consolidated.* copy (a second, differently
    named copy of the same weights that some repositories ship beside the HF shards)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {model_dir}: {missing}")
        return [model_dir / n for n in names]
    files = sorted(p for p in model_dir.glob("*.safetensors")
                   if not p.name.startswith("consolidated"))
    if not files:
        found = sorted(p.name for p in model_dir.iterdir())
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (found {found}); "
                                "expected model.safetensors or shards with " + INDEX_FILE)
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the files, read one at a time (memory-mapped)."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto",
               device: torch.device | str = "cpu",
               attention_backend: AttentionBackend | None = None) -> tuple[LlamaModel, ModelConfig]:
    """Read `model_dir` into an eval-mode LlamaModel on `device` in `dtype`. attention_backend:
    the engine's (raypaged/model/setup.py), or None: Triton on CUDA, torch elsewhere."""
    config = ModelConfig.from_dir(model_dir)  # first: it refuses a folder that does not exist
    files = checkpoint_files(model_dir)
    # a torch.dtype is ModelSetup's, already resolved
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = LlamaModel(config, attention_backend or get_attention_backend(None, device))
    model = model.to(torch_dtype).to_empty(device=device)
    model.load_weights(iter_checkpoint(files))
    return model.eval(), config
