"""How a model runs here, decided once: device, dtype, length, KV shape and budget, attention
backend, threads. The engine, `raypaged plan`, and the benchmarks and GPU tests that run random
weights all go through ModelSetup, so no two of them decide differently.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from raypaged.config import EngineArgs, KVPlan, KVShape, plan_kv_cache
from raypaged.core.engine_core import EngineCore
from raypaged.core.scheduler import Scheduler
from raypaged.core.scheduling_policy import policy_of
from raypaged.kernels import cpu_paged_decode
from raypaged.model.attention import AttentionBackend, TorchAttentionBackend, get_attention_backend
from raypaged.model.input_buffers import InputBuffers
from raypaged.model.kv_cache import allocate_kv_caches, kv_storage_dtype
from raypaged.model.loader import checkpoint_files, resolve_dtype
from raypaged.model.model_config import ModelConfig
from raypaged.model.runner import CudaGraphDecoder, ModelRunner
from raypaged.model.sampler import Sampler

log = logging.getLogger(__name__)


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from raypaged.model.default_model import default_model_dir
        return default_model_dir()
    return Path(model).expanduser()


@dataclass(frozen=True)
class ModelSetup:
    args: EngineArgs
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    model_dir: Path | None  # None: a model built in memory (random weights on a GPU box)

    @classmethod
    def decide(cls, args: EngineArgs, config: ModelConfig | None = None) -> ModelSetup:
        """From the model folder's config.json, or from `config` for a model built in memory."""
        model_dir = None
        if config is None:
            model_dir = resolve_model_dir(args.model)
            config = ModelConfig.from_dir(model_dir)
        limit = config.max_model_len
        if (args.max_model_len or 0) > limit:
            raise ValueError(f"max_model_len={args.max_model_len} is longer than the model's limit "
                             f"of {limit} tokens: set max_model_len <= {limit}")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return cls(args, config, device, resolve_dtype(args.dtype, device),
                   args.max_model_len or limit, model_dir)

    @cached_property
    def kv_cache_dtype(self) -> torch.dtype:
        """The element type the KV cache stores: sizes the plan, picks the kernels, allocates."""
        return kv_storage_dtype(self.dtype, self.args.kv_dtype)

    @cached_property
    def kv_shape(self) -> KVShape:
        return KVShape(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim,
                       self.kv_cache_dtype.itemsize)

    def plan(self, weights_loaded: bool = False) -> KVPlan:
        """The block pool this engine gets. On a GPU the budget is a fraction of the memory left
        after the weights: measured once they are loaded, estimated from the files before."""
        free = None
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            if not weights_loaded and self.model_dir is not None:
                free -= sum(f.stat().st_size for f in checkpoint_files(self.model_dir))
        return plan_kv_cache(self.kv_shape, self.args, self.max_model_len, free)

    def attention_backend(self) -> AttentionBackend:
        """torch (+ the C++ kernels on CPU) or Triton, refusing what the GPU at hand cannot run."""
        args, cuda = self.args, self.device.type == "cuda"
        if (args.attention_backend or ("triton" if cuda else "torch")) == "torch":
            cpu = self.device.type == "cpu"
            return TorchAttentionBackend(
                cpu_decode_kernel(self.config, self.dtype, self.kv_cache_dtype, args.block_size)
                if cpu and args.cpu_decode_kernel else None,
                cpu_prefill_kernel(self.config, self.dtype, self.kv_cache_dtype)
                if cpu and args.cpu_prefill_kernel else None,
                cpu_paged_decode.store_kv if self.layer_kernels else None)
        if cuda:  # refuse what its kernels cannot run on this GPU
            from raypaged.model.attention.gpu_support import check_triton_kv_dtype
            check_triton_kv_dtype(torch.cuda.get_device_capability(self.device), args.kv_dtype,
                                  str(self.dtype).removeprefix("torch."))
        # the split-K workspace for this engine's batch; max_model_len fixes the split rule
        return get_attention_backend("triton", self.device, max_num_seqs=args.max_num_seqs,
                                     max_model_len=self.max_model_len)

    def load_model(self):
        """The model's weights on the device, in the dtype and backend decided here."""
        from raypaged.model.loader import load_model
        from raypaged.model.llama import can_pack, pack_linears, use_layer_kernels

        bound_kernel_caches(self.args.onednn_cache_capacity)  # before the first matmul reads it
        model, _ = load_model(self.model_dir, self.dtype, self.device, self.attention_backend())
        if self.args.packed_linears and can_pack(self.dtype, self.device):
            pack_linears(model)
        if self.layer_kernels:
            use_layer_kernels(model, cpu_paged_decode.rms_norm_bf16,
                              cpu_paged_decode.add_rms_norm_bf16, cpu_paged_decode.rotary_bf16)
        return model

    @cached_property
    def layer_kernels(self) -> bool:
        """Whether a bf16 CPU model runs its layers' glue (norms, residual adds, rotary, KV writes)
        by the C++ kernels: --cpu-layer-kernels, where they build."""
        return (self.args.cpu_layer_kernels and self.device.type == "cpu"
                and self.dtype == torch.bfloat16 and cpu_layer_kernels_built())

    def build_core(self, model, grammars=None) -> tuple[EngineCore, KVPlan, ModelRunner]:
        """A loaded (or randomly initialised) model -> its runner (KV cache sized by the plan,
        buffers, CUDA graphs, sampler) under a scheduler of the same plan. GPU tests and
        benchmarks call this with random weights of real shapes. grammars: the GrammarCache
        constrained requests compile into (None: none accepted)."""
        args = self.args
        plan = self.plan(weights_loaded=True)
        kv_caches = allocate_kv_caches(self.config, plan.num_blocks, args.block_size,
                                       self.kv_cache_dtype, self.device)
        buffers = InputBuffers(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len,
                               args.block_size, self.device)
        graphs = None
        if self.device.type == "cuda" and not args.enforce_eager and model.backend.name == "triton":
            graphs = CudaGraphDecoder(model, kv_caches, args.max_num_seqs, self.max_model_len,
                                      buffers)
            if not graphs.capture():
                graphs = None
        runner = ModelRunner(model, kv_caches, buffers, Sampler(args.seed, grammars), graphs,
                             args.num_threads,
                             args.decode_threads if self.device.type == "cpu" else None)
        scheduler = Scheduler(plan.num_blocks, args.block_size, plan.max_model_len,
                              args.max_num_seqs, args.max_num_batched_tokens,
                              args.enable_prefix_caching, policy_of(args))
        return EngineCore(scheduler, runner, args.async_scheduling), plan, runner


def cpu_decode_kernel(config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                      block_size: int):
    """The C++ decode attention for this model and cache, or None (with a warning saying why and
    what to do) where it cannot serve them or cannot be built here."""
    why = cpu_paged_decode.unsupported(dtype, kv_dtype, config.num_heads, config.num_kv_heads,
                                       config.head_dim, block_size)
    try:
        if why is None:
            cpu_paged_decode.load()
            return cpu_paged_decode.paged_decode
    except RuntimeError as e:
        why = str(e)
    log.warning("C++ decode attention off, gather + SDPA instead: %s (install g++ and ninja, or "
                "pass --no-cpu-decode-kernel to choose this path)", why)
    return None


def cpu_layer_kernels_built() -> bool:
    """Whether the C++ RMSNorm and rotary kernels can run here (else a warning saying why)."""
    try:
        cpu_paged_decode.load()
        return True
    except RuntimeError as e:
        log.warning("C++ RMSNorm and rotary kernels off, torch's ops instead: %s (install g++ "
                    "and ninja, or pass --no-cpu-layer-kernels to choose torch's ops)", e)
        return False


def cpu_prefill_kernel(config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype):
    """The C++ bf16 prefill attention for this model and cache, or None where it does not apply
    (fp32, an fp8 cache, another head dim: SDPA, as designed, logged at info) or cannot run here
    (no AVX512-BF16, no compiler: SDPA, with a warning saying what it costs)."""
    why = cpu_paged_decode.prefill_unsupported(dtype, kv_dtype, config.num_heads,
                                               config.num_kv_heads, config.head_dim)
    if why is not None:
        log.info("C++ prefill attention off, SDPA instead: %s", why)
        return None
    try:
        if cpu_paged_decode.prefill_built():
            return cpu_paged_decode.paged_prefill
    except RuntimeError as e:
        why = str(e)
    log.warning("C++ prefill attention off, SDPA instead (about half the speed on long prompts): "
                "%s (pass --no-cpu-prefill-kernel to choose SDPA)",
                why or "this CPU has no AVX512-BF16")
    return None


# Bound oneDNN's per-shape kernel caches, the source of a CPU worker's RSS growth under load.
#
# On a CPU, bf16 linear layers, and fp32 ones once packed (llama.py's pack_linears), run through
# oneDNN (via ideep). Both libraries keep an LRU cache of compiled matmul primitives keyed by the exact
# input shape (`LRU_CACHE_CAPACITY`, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`). Continuous batching gives
# nearly every mixed prefill/decode step a new token count, so the caches fill with kernels of
# shapes that never come back (their cost: `benchmarks/memory_probe.py --cache-cost`). A small LRU
# keeps the shapes that do come back (decode steps of the current batch sizes); a miss costs
# building the primitive, once per new shape and step, not per layer.
#
# Both libraries read their capacity once, at their first primitive: set it before the process's
# first oneDNN matmul (ModelSetup.load_model does, before the model runs). Unpacked fp32 linears
# go through MKL, which keeps no such cache.

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


def plan_for(args: EngineArgs) -> KVPlan:
    """The "what fits" report without loading weights."""
    return ModelSetup.decide(args).plan()
