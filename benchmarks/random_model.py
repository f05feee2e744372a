"""A randomly initialised model with a real config, for GPU runs where weights cannot travel.

Speed does not depend on weight values. Embeddings and an untied LM head get std 1 by default (so
logits have wide margins and greedy picks are not near-ties that bf16 rounding could flip); other
weights std 0.02 as in HF init; norms 1.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from raypaged.config import EngineArgs
from raypaged.model.llama import LlamaModel
from raypaged.model.model_config import ModelConfig
from raypaged.model.setup import ModelSetup

CONFIGS = Path(__file__).resolve().parent / "configs"


def config_named(name: str) -> ModelConfig:
    """benchmarks/configs/<name>.json: a real model's config.json."""
    return ModelConfig.from_dict(json.loads((CONFIGS / f"{name}.json").read_text()))


def random_model(config_name: str, args: EngineArgs, seed: int = 0,
                 embed_std: float = 1.0) -> tuple[LlamaModel, ModelSetup]:
    """The model of `config_name` with random weights, run as `args` says (device, dtype,
    attention backend: decided by ModelSetup, as for a loaded model). With tied embeddings and
    embed_std 1 (SmolLM2) greedy decoding repeats the prompt's last token whatever attention
    computes (|embedding|^2 dominates its logit); tests that compare attention paths pass a
    smaller embed_std, whose outputs depend on attention (and whose margins are narrower)."""
    setup = ModelSetup.decide(args, config_named(config_name))
    torch.manual_seed(seed)
    with torch.device(setup.device):
        model = LlamaModel(setup.config, setup.attention_backend())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, embed_std)
            else:
                p.normal_(0, 0.02)
    return model.to(setup.dtype).eval(), setup
