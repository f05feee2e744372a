"""The engine refuses, at start, a KV dtype its Triton kernels cannot run on the GPU at hand.

No GPU needed: the device's capability is an A100's. The refusal must come from ModelSetup's
choice of attention backend, before the model is built or any KV cache allocated."""
import json
from pathlib import Path

import pytest
import torch

from raypaged.config import EngineArgs
from raypaged.model.model_config import ModelConfig
from raypaged.model.setup import ModelSetup

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "smollm2-135m.json"


def test_fp8_kv_on_an_sm80_gpu_is_refused_at_engine_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    setup = ModelSetup.decide(EngineArgs(kv_dtype="fp8_e4m3", attention_backend="triton",
                                         device="cuda"),
                              ModelConfig.from_dict(json.loads(CONFIG.read_text())))
    with pytest.raises(ValueError, match=r"compute capability 8\.0.*kv_dtype 'auto'"):
        setup.attention_backend()
