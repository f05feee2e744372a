"""Rotary position embeddings (RoPE), in the "rotate half" layout Hugging Face checkpoints use.

A head vector x of size D is split into halves x1 = x[:D/2], x2 = x[D/2:]; pair i (x1[i], x2[i])
is rotated by angle position * inv_freq[i]:
    out = [x1*cos - x2*sin, x2*cos + x1*sin]
cos/sin are computed once per forward from the step's positions (T x D/2 values, cheap) and
shared by every layer, so there is no table sized by max_position_embeddings to keep around.
"""
from __future__ import annotations

import math

import torch

from raypaged.model.model_config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequencies, computed exactly as transformers does
    (same op order, so fp32 results match bit for bit)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the original context / low_freq_factor are slowed by
    # `factor`; shorter than context / high_freq_factor are kept; in between, blend smoothly.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds inv_freq (a plain tensor, not a module buffer: the model is built on the meta device
    and materialised with to_empty(), which would leave a buffer uninitialised)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [D/2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin each [T, 1, D/2] in `dtype` (broadcast over heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)  # moved once, then reused
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2] float32
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D] (may be a strided view), cos/sin [T, 1, D/2] -> rotated [T, N, D], contiguous."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, N, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
