"""A randomly initialised model with a real config, for GPU runs where weights cannot travel.

Speed does not depend on weight values. Embeddings get std 1 (so tied logits have wide margins
and greedy picks are not near-ties that rounding could flip); other weights std 0.02 as in HF
init; norms 1.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from raypaged.model.attention import get_attention_backend
from raypaged.model.llama import LlamaModel
from raypaged.model.model_config import ModelConfig

CONFIGS = Path(__file__).resolve().parent / "configs"


def random_model(config_name: str, backend: str, dtype: torch.dtype, device: str = "cuda",
                 seed: int = 0) -> tuple[LlamaModel, ModelConfig]:
    config = ModelConfig.from_dict(json.loads((CONFIGS / f"{config_name}.json").read_text()))
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(config, get_attention_backend(backend, device))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.02)
    return model.to(dtype).eval(), config
