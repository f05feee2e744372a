"""Counter-based random numbers for sampling: a row's noise is a pure function of (key, vocab index).

No generator state: the uniforms of a row depend on its 64-bit key and nothing else, so a row
draws the same numbers whatever else is in the batch, and a preempted request that recomputes
output position p draws what it drew the first time. Keys are mixed on the host (one Python int
per row per step); the [rows, vocab] noise is integer tensor ops on the logits' device:

    key[i]   = splitmix64(seed, sample index, output position)           host
    x[i, v]  = mix32(mix32(vocab_hash[v] ^ key_lo[i]) ^ key_hi[i])       device, [N, V]
    u[i, v]  = ((x >> 9) + 0.5) / 2^23                                   in (0, 1), float32

23 bits, not 24: (2^24 - 1 + 0.5) is no float32 and rounds to 2^24, which gives u = 1.0,
q = -log u = 0 and p / q = 0 / 0 = NaN for every p = 0 entry, which argmax takes: a token the
grammar mask (or top-k/top-p) removed would be drawn. With 23 bits every value is exact and
u <= 1 - 2^-24.

Every product is a value < 2^32 times a constant < 2^31, so int64 arithmetic never overflows and
any device computes the same bits.
"""
from __future__ import annotations

import functools

import torch

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(*words: int) -> int:
    """Mix integers (any size, any sign) into one 64-bit key."""
    x = 0
    for w in words:
        x = (x ^ (w & _M64)) + 0x9E3779B97F4A7C15 & _M64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
        x ^= x >> 31
    return x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix, in place on an int64 tensor holding values in [0, 2^32)."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x1B873593).bitwise_and_(_M32)
    x ^= x >> 16
    return x


@functools.cache
def _hashed_vocab(vocab: int, device: torch.device) -> torch.Tensor:
    """mix32 of every vocab index, computed once per (vocab size, device)."""
    return _mix32(torch.arange(vocab, dtype=torch.int64, device=device))


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys: [N] int64 on the target device (64-bit keys as signed ints) -> [N, vocab] float32 in (0, 1)."""
    lo = (keys & _M32).unsqueeze(1)                        # [N, 1]
    hi = ((keys >> 32) & _M32).unsqueeze(1)                # [N, 1]
    x = _hashed_vocab(vocab, keys.device).unsqueeze(0) ^ lo  # [N, V] int64
    return unit_interval(_mix32(_mix32(x) ^ hi))


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """32-bit ints (in int64) -> float32 strictly inside (0, 1): see the module's docstring."""
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def as_signed(key: int) -> int:
    """A 64-bit key as the int64 value a tensor can hold."""
    return key - (1 << 64) if key >= 1 << 63 else key
