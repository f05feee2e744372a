"""Engine configuration: frozen, validated once, with errors that name the setting and the fix.

Values discovered at run time (the number of KV blocks, the model's max length) are returned by
`plan_kv_cache` and passed on; they are never written back into these objects.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from raypaged.settings import setting, validate

BLOCK_SIZES = (8, 16, 32)
KV_DTYPES = ("auto", "fp8_e4m3")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
CPU_DEFAULT_KV_MB = 2048         # a modest fixed budget: a CPU has no "free device memory" to share
GPU_DEFAULT_KV_FRACTION = 0.9    # of device memory left after weights


def absolute_model_path(path: str | None) -> str | None:
    """Workers may run in another directory, or on another node: name a model folder absolutely."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


ENGINE = "model and KV cache"
SCHEDULER = "scheduler and execution"

# Scheduling rules (raypaged/core/scheduling_policy.py, docs/scheduling.md)
HEADROOM = "headroom"  # admit only while the running set's projected growth still fits
FITS = "fits"          # admit whatever fits now (the first rule)
BOUNDED = "bounded"    # victim: least computed work among those preempted fewer times
NEWEST = "newest"      # victim: the newest running request (the first rule)


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting, declared once (see raypaged.settings): `raypaged generate | plan |
    serve` flags, the Serve application's arguments and `LLM(**kwargs)` all come from here."""

    model: str | None = setting(
        None, "local Hugging Face folder (config.json + safetensors); default: SmolLM2-135M-Instruct",
        group=ENGINE)
    dtype: str = setting("auto", "weights and activations; auto: bf16 on a GPU or a CPU with native "
                         "bf16 matmuls, else fp32", group=ENGINE, choices=DTYPE_CHOICES)
    block_size: int = setting(16, "tokens per KV block", group=ENGINE, choices=BLOCK_SIZES)
    # The KV budget: at most one of these three; none = the device default (see plan_kv_cache).
    kv_memory_mb: float | None = setting(None, "KV cache budget in MiB (CPU default: "
                                         f"{CPU_DEFAULT_KV_MB})", group=ENGINE, gt=0)
    kv_memory_fraction: float | None = setting(
        None, "KV budget as a fraction of free GPU memory after weights (GPU default: "
        f"{GPU_DEFAULT_KV_FRACTION})", group=ENGINE, gt=0, le=1)
    kv_context_len: int | None = setting(None, "size the pool to hold this many tokens",
                                         group=ENGINE, ge=1)
    kv_dtype: str = setting("auto", "KV cache element type; fp8_e4m3 halves KV memory (with a "
                            "per-tensor scale)", group=ENGINE, choices=KV_DTYPES)
    enable_prefix_caching: bool = setting(True, "reuse cached KV blocks of shared prompt prefixes",
                                          group=ENGINE)
    max_model_len: int | None = setting(None, "longest prompt + output (default: the model's)",
                                        group=SCHEDULER, ge=1)
    max_num_seqs: int = setting(256, "sequences running at once", group=SCHEDULER, ge=1)
    max_num_batched_tokens: int = setting(
        2048, "per-step token budget; longer prompts are prefilled in chunks", group=SCHEDULER, ge=1)
    # benchmarks/kv_waste.py compares the rules (docs/scheduling.md)
    admission_policy: str = setting(
        HEADROOM, "headroom: admit a waiting request only while the free KV blocks cover a "
        "watermark plus the projected decode growth of everything running (from max_tokens, or "
        "the mean output length seen when max_tokens is open); fits: admit whatever fits now "
        "(more preemptions)", group=SCHEDULER, choices=(HEADROOM, FITS))
    preemption_policy: str = setting(
        BOUNDED, "when KV blocks run out: bounded: preempt the request with the least computed "
        "work among those preempted fewer than --protect-after-preemptions times, and resume "
        "preempted requests in arrival order; newest: preempt the newest", group=SCHEDULER,
        choices=(BOUNDED, NEWEST))
    kv_watermark: float = setting(
        0.01, "headroom admission: fraction of KV blocks kept free beyond the projection",
        group=SCHEDULER, ge=0, le=0.5)
    decode_reserve: float = setting(
        1.0, "headroom admission: fraction of each running request's projected remaining "
        "output reserved (below 1 admits more and risks preemptions)", group=SCHEDULER,
        ge=0, le=1)
    protect_after_preemptions: int = setting(
        1, "bounded preemption: a request preempted this many times is not chosen again while "
        "another running request can be", group=SCHEDULER, ge=1)
    attention_backend: str | None = setting(None, "default: triton on CUDA, torch elsewhere",
                                            group=SCHEDULER, choices=("torch", "triton"))
    enforce_eager: bool = setting(False, "no CUDA graphs", group=SCHEDULER)
    output_thread: bool = setting(
        True, "serving: detokenize and check stop strings on a thread of their own, off the step "
        "loop (offline generate always does it in line)", group=SCHEDULER)
    async_scheduling: bool = setting(
        False, "overlapped scheduling: schedule the next step while the model runs this one "
        "(off by default: on this CPU it saves a few ms per step only at 256 sequences and costs "
        "~0.3 ms at 1, and no GPU has measured it yet)",
        group=SCHEDULER)
    device: str | None = setting(None, "torch device; default: cuda if available, else cpu",
                                 group=SCHEDULER, cli=False, serve=False)
    num_threads: int | None = setting(
        None, "torch CPU threads (serve default: the worker's CPUs)", group=SCHEDULER, ge=1)
    decode_threads: int | None = setting(
        None, "CPU: torch threads for decode-only steps (default: num_threads; serving: one fewer "
        "than the worker's CPUs, leaving a core to the serving path around the model)",
        group=SCHEDULER, ge=1)
    seed: int = setting(0, "the sampler's seed for requests that give none", group=SCHEDULER,
                        cli=False, serve=False)
    # benchmarks/forward_step.py measures the step with and without it (docs/performance.md)
    packed_linears: bool = setting(
        True, "CPU bf16 and fp32: reorder linear weights once into oneDNN's blocked layout "
        "(bf16: same bits, faster decode; fp32: oneDNN instead of MKL, within a few ulps)",
        group=SCHEDULER)
    cpu_decode_kernel: bool = setting(
        True, "CPU: decode attention by a C++ kernel that reads the paged KV cache in place "
        "(built once per machine with the local g++, then cached; where it cannot be built, "
        "a warning and the gather + SDPA path)", group=SCHEDULER)
    # benchmarks/cpu_prefill_attention.py measures the kernel against SDPA per layer call
    cpu_prefill_kernel: bool = setting(
        True, "CPU, bf16: prefill attention by a C++ kernel on AVX512-BF16 that reads the paged "
        "KV cache in place (~2x torch's SDPA on long prompts); other CPUs, dtypes and head dims "
        "keep SDPA", group=SCHEDULER)
    # benchmarks/layer_kernels.py measures it offline, vs_vllm.py with a --no-cpu-layer-kernels
    # variant served (docs/performance.md)
    cpu_layer_kernels: bool = setting(
        True, "CPU, bf16: each layer's RMSNorms (with the residual add before them), rotary "
        "embedding and KV cache write by one C++ call each instead of several small torch ops "
        "(the same bits; faster decode at small batches)",
        group=SCHEDULER)
    # model/grammar.py: xgrammar's compile cannot be interrupted, so past this the request fails
    # and its thread finishes the compile in the background (later identical specs fail at once)
    max_structured_output_compile_s: float = setting(
        10.0, "seconds one structured-outputs grammar may take to compile on a worker (waiting "
        "behind other compiles not counted); a request whose grammar takes longer fails",
        group=SCHEDULER, gt=0)
    onednn_cache_capacity: int = setting(
        128, "oneDNN kernels kept per input shape on CPU (bf16, and fp32 packed linears; 1024: "
        "the libraries' default, which grows RSS by ~0.6 GiB under load)", group=SCHEDULER, ge=1)

    def __post_init__(self) -> None:
        validate(self)
        budgets = [k for k in ("kv_memory_mb", "kv_memory_fraction", "kv_context_len")
                   if getattr(self, k) is not None]
        if len(budgets) > 1:
            raise ValueError(f"set at most one KV budget, got {sorted(budgets)}: "
                             "use kv_memory_mb, kv_memory_fraction or kv_context_len")


@dataclass(frozen=True)
class KVShape:
    """What the KV cache needs to know of a model (no torch here)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # bytes per cached element: 4 fp32, 2 bf16/fp16, 1 fp8

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V


@dataclass(frozen=True)
class KVPlan:
    """The "what fits" report for one worker."""

    kv_budget_bytes: int
    bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_seqs_at_max_model_len(self) -> int:
        return self.num_blocks // self.blocks_per_seq

    def report(self) -> str:
        mib = 1024 * 1024
        return "\n".join([
            f"KV budget            {self.kv_budget_bytes / mib:,.1f} MiB",
            f"bytes per token      {self.bytes_per_token:,}",
            f"block size           {self.block_size} tokens ({self.bytes_per_block / 1024:,.1f} KiB)",
            f"blocks               {self.num_blocks:,}",
            f"tokens that fit      {self.num_tokens:,}",
            f"max_model_len        {self.max_model_len:,}",
            f"sequences of max_model_len that fit concurrently  {self.max_seqs_at_max_model_len:,}",
        ])


def plan_kv_cache(shape: KVShape, cache: EngineArgs, max_model_len: int,
                  free_device_bytes: int | None) -> KVPlan:
    """Size the block pool. `free_device_bytes` is memory left after weights (None on a CPU).
    Refuses a budget in which one sequence of max_model_len cannot fit, saying what would fit."""
    per_token = shape.bytes_per_token
    per_block = per_token * cache.block_size
    if cache.kv_context_len is not None:
        budget = -(-cache.kv_context_len // cache.block_size) * per_block
    elif cache.kv_memory_mb is not None:
        budget = int(cache.kv_memory_mb * 1024 * 1024)
    elif free_device_bytes is not None:
        budget = int((cache.kv_memory_fraction or GPU_DEFAULT_KV_FRACTION) * free_device_bytes)
    elif cache.kv_memory_fraction is not None:
        raise ValueError("kv_memory_fraction needs a GPU (a fraction of free device memory); "
                         "on a CPU set kv_memory_mb or kv_context_len instead")
    else:
        budget = CPU_DEFAULT_KV_MB * 1024 * 1024
    num_blocks = budget // per_block
    plan = KVPlan(budget, per_token, cache.block_size, num_blocks, max_model_len)
    if plan.max_seqs_at_max_model_len < 1:
        need_mb = plan.blocks_per_seq * per_block / (1024 * 1024)
        raise ValueError(
            f"one sequence of max_model_len={max_model_len} needs {plan.blocks_per_seq} KV blocks "
            f"({need_mb:,.1f} MiB) but the budget of {budget / (1024 * 1024):,.1f} MiB holds "
            f"{num_blocks} blocks: set max_model_len <= {plan.num_tokens} or raise the KV budget "
            f"to at least kv_memory_mb={need_mb:,.1f}")
    return plan
