"""The engine refuses, at start, a KV dtype its Triton kernels cannot run on the GPU at hand.

No GPU needed: a one-parameter stand-in model says its backend is Triton and the device's
capability is an A100's. The refusal must come from assemble_core, before any KV allocation."""
import pytest
import torch

from raypaged.engine import EngineArgs, assemble_core


class TritonModelStandIn(torch.nn.Linear):
    class backend:
        name = "triton"


def test_fp8_kv_on_an_sm80_gpu_is_refused_at_engine_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    model = TritonModelStandIn(1, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"compute capability 8\.0.*kv_dtype 'auto'"):
        assemble_core(model, None, EngineArgs(kv_dtype="fp8_e4m3"), torch.device("cuda"))
