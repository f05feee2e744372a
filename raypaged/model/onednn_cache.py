"""Bound oneDNN's per-shape kernel caches, the source of a CPU worker's RSS growth under load.

On a CPU, bf16 linear layers, and fp32 ones once packed (packed_linear.py), run through oneDNN
(via ideep). Both libraries keep an LRU cache of compiled matmul primitives keyed by the exact
input shape (`LRU_CACHE_CAPACITY`, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`). Continuous batching gives
nearly every mixed prefill/decode step a new token count, so the caches fill with kernels of
shapes that never come back (their cost: `benchmarks/memory_probe.py --cache-cost`). A small LRU
keeps the shapes that do come back (decode steps of the current batch sizes); a miss costs
building the primitive, once per new shape and step, not per layer.

Both libraries read their capacity once, at their first primitive: set it before the process's
first oneDNN matmul (Engine.from_args does, before the model runs). Unpacked fp32 linears go through
MKL, which keeps no such cache.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

CACHE_ENV_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
LIBRARY_DEFAULT = 1024  # both libraries' own capacity


def bound_kernel_caches(capacity: int) -> None:
    """Cap both caches at `capacity` shapes each, unless the environment already sets them."""
    if capacity < 1:
        # ideep's LRU cache crashes the process (SIGSEGV) at capacity 0
        raise ValueError(f"onednn_cache_capacity must be >= 1, got {capacity}: use 1 for the "
                         f"least memory, or {LIBRARY_DEFAULT} for the libraries' default")
    for name in CACHE_ENV_VARS:
        if name in os.environ and os.environ[name] != str(capacity):
            log.info("%s=%s from the environment wins over onednn_cache_capacity=%d",
                     name, os.environ[name], capacity)
        os.environ.setdefault(name, str(capacity))
