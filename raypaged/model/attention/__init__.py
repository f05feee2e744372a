"""Attention backends: `torch` (any device; the CPU path and the reference) and `triton` (CUDA)."""
from __future__ import annotations

import torch

from raypaged.model.attention.base import AttentionBackend
from raypaged.model.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str | None, device: torch.device | str,
                          **triton_options) -> AttentionBackend:
    """None picks Triton on CUDA and torch elsewhere. Triton is imported only when chosen, so
    CPU installs never need it to import cleanly. triton_options: TritonAttentionBackend's
    (max_num_seqs, max_model_len: its split-K workspace)."""
    device = torch.device(device)
    name = name or ("triton" if device.type == "cuda" else "torch")
    if name == "torch":
        return TorchAttentionBackend()
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device} "
                         f"(cuda available: {torch.cuda.is_available()}); use 'torch' on CPU")
    try:
        from raypaged.model.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:
        raise ImportError(f"attention backend 'triton' could not be imported ({e}); "
                          "install triton or choose 'torch'") from e
    return TritonAttentionBackend(**triton_options)
