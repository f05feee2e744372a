"""The one way to build an engine: config -> model, KV cache, runner, scheduler, tokenizer.

The offline `LLM` and the worker actor both call `build_engine`; `Engine` adds
tokenizer-side work (detokenization, stop strings, extra EOS ids) on top of core's EngineCore.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable

import torch

from raypaged.config import EngineArgs, KVPlan, KVShape, plan_kv_cache
from raypaged.core.contracts import Continuation, EngineStats, RequestDelta
from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from raypaged.core.scheduling_policy import policy_of
from raypaged.model.onednn_cache import bound_kernel_caches
from raypaged.output_processor import OutputProcessor
from raypaged.output_stage import OutputStage
from raypaged.outputs import SequenceOutput

log = logging.getLogger(__name__)


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from raypaged.model.default_model import default_model_dir
        return default_model_dir()
    return Path(model).expanduser()


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    if requested is None:
        return model_limit
    if requested > model_limit:
        raise ValueError(f"max_model_len={requested} is longer than the model's limit of "
                         f"{model_limit} tokens: set max_model_len <= {model_limit}")
    return requested


def resolve_dtype_name(dtype: str, device: torch.device) -> str:
    """"auto": bf16 on a GPU; on a CPU bf16 where it has native bf16 matmuls (AVX512-BF16 / AMX:
    2x fp32's speed on our 2-core EPYC, benchmarks/offline_throughput.py), else fp32."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bfloat16"
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def plan_for(args: EngineArgs) -> KVPlan:
    """The "what fits" report without loading weights (CPU budget rules; GPU uses free memory)."""
    from raypaged.model.kv_cache import kv_bytes_per_token
    from raypaged.model.loader import resolve_dtype
    from raypaged.model.model_config import ModelConfig

    config = ModelConfig.from_dir(resolve_model_dir(args.model))
    device = resolve_device(args.device)
    dtype = resolve_dtype(resolve_dtype_name(args.dtype, device), device)
    per_token = kv_bytes_per_token(config, dtype, args.kv_dtype)
    shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim,
                    per_token // (2 * config.num_layers * config.num_kv_heads * config.head_dim))
    free = None
    if device.type == "cuda":
        weight_bytes = sum(f.stat().st_size for f in resolve_model_dir(args.model).glob("*.safetensors"))
        free = torch.cuda.mem_get_info(device)[0] - weight_bytes
    max_len = resolve_max_model_len(args.max_model_len, config.max_model_len)
    return plan_kv_cache(shape, args, max_len, free)


class Engine:
    """EngineCore plus the tokenizer side. Outputs come back from `step()` / `abort()` (in line),
    or, once `start_output_stage(sink)` has run, from the output stage's thread to `sink`."""

    def __init__(self, core: EngineCore, tokenizer, plan: KVPlan, model_name: str,
                 eos_token_ids: tuple[int, ...], runner=None, output_thread: bool = False) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.plan = plan
        self.model_name = model_name
        self.max_model_len = plan.max_model_len
        self.block_size = plan.block_size
        self.eos_token_ids = eos_token_ids
        self.runner = runner
        self.output_thread = output_thread  # whether serving should start the output stage
        self.outputs = OutputProcessor(tokenizer)
        self.stage: OutputStage | None = None

    def start_output_stage(self, sink: Callable[[list[SequenceOutput]], None]) -> None:
        """From now on detokenize on a thread of its own: step() and abort() return [] and every
        output goes to sink, called on that thread. The caller (the serving step thread) must
        be the only thread calling this engine's other methods."""
        assert self.stage is None and not self.core.has_unfinished(), "start before any request"
        self.stage = OutputStage(self.outputs, sink)

    def stop_output_stage(self) -> None:
        if self.stage is not None:
            self.stage.stop()
            self.stage = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, continuation: Continuation | None = None) -> None:
        """Queue a request; raises ValueError with the reason when it can never be served.
        A continuation resumes one sample begun on another engine (serving's failover)."""
        if not isinstance(request_id, str) or not request_id or "#" in request_id:
            raise ValueError(f"request_id must be a non-empty string without '#', got {request_id!r}")
        # With an output stage this reads the stage thread's map; a dict lookup is atomic, and
        # a request id the stage is about to forget is one core has finished with anyway.
        if self.outputs.tracks(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        # Re-check here whatever the caller validated: nothing unchecked reaches step().
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:
            # further EOS ids (Llama 3's <|eot_id|>, say) stop generation like stop tokens
            extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        vocab = len(self.tokenizer)
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        params.check_token_ids(vocab)
        if continuation is not None and any(
                not isinstance(t, int) or not 0 <= t < vocab for t in continuation.output_token_ids):
            raise ValueError(f"continuation token ids must be integers in [0, {vocab})")
        prompt = list(prompt_token_ids)
        self.core.add_request(request_id, prompt, params, eos, cache_salt, continuation)
        detok = self.outputs.detokenizer(prompt, params)
        if continuation is not None:
            try:  # here, not on the stage: the caller learns at once that it does not fit
                detok.resume(continuation.output_token_ids, continuation.text_chars)
            except ValueError:
                self.core.abort(request_id)  # nothing tracks it yet: its deltas go nowhere
                raise
        index = continuation.sample_index if continuation else 0
        if self.stage is None:
            self.outputs.add(request_id, prompt, params, index, detok)
        else:
            self.stage.add(request_id, prompt, params, index, detok)

    def step(self) -> list[SequenceOutput]:
        if self.stage is not None:
            self._apply_stage_aborts()
        return self._emit(self.core.step())

    def abort(self, request_id: str) -> list[SequenceOutput]:
        """Finish a request and all its samples now, in any state, freeing their blocks."""
        return self._emit(self.core.abort(request_id))

    def _emit(self, deltas: list[RequestDelta]) -> list[SequenceOutput]:
        if self.stage is not None:
            self.stage.submit(deltas)
            return []
        outs, aborts = self.outputs.process(deltas)
        for seq_id, reason in aborts:  # in line: core hears of a stop string before the next step
            dropped, more = self.outputs.process(self.core.abort(seq_id, reason, with_samples=False))
            assert not dropped and not more, "a sequence ended by the processor has no more outputs"
        return outs

    def _apply_stage_aborts(self) -> None:
        """Sequences the output stage ended (stop strings) leave core before the next step."""
        aborts = self.stage.aborts
        while aborts:
            seq_id, reason = aborts.popleft()
            self.stage.submit(self.core.abort(seq_id, reason, with_samples=False))

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def cache_summary(self):
        return self.core.cache_summary()

    def stats(self) -> EngineStats:
        return self.core.stats()


def build_engine(args: EngineArgs) -> Engine:
    """Load the model and tokenizer named by `args` and assemble a ready engine."""
    from transformers import AutoTokenizer

    from raypaged.model.loader import load_model
    from raypaged.model.packed_linear import can_pack, pack_linears

    bound_kernel_caches(args.onednn_cache_capacity)  # before the first matmul reads it
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dir = resolve_model_dir(args.model)
    device = resolve_device(args.device)
    model, mcfg = load_model(model_dir, resolve_dtype_name(args.dtype, device), device,
                             args.attention_backend)
    if args.packed_linears and can_pack(next(model.parameters()).dtype, device):
        pack_linears(model)
    core, plan, runner = assemble_core(model, mcfg, args, device)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    name = args.model or "SmolLM2-135M-Instruct"
    return Engine(core, tokenizer, plan, name, mcfg.eos_token_ids, runner, args.output_thread)


def cpu_decode_kernel(mcfg, cache, dtype: torch.dtype):
    """The C++ decode attention for this model and cache, or None (with a warning saying why and
    what to do) where it cannot serve them or cannot be built here."""
    from raypaged.kernels import cpu_paged_decode

    why = cpu_paged_decode.unsupported(dtype, cache.key.dtype, mcfg.num_heads, mcfg.num_kv_heads,
                                       mcfg.head_dim, cache.block_size)
    if why is None:
        try:
            cpu_paged_decode.load()
        except RuntimeError as e:
            why = str(e)
    if why is not None:
        log.warning("C++ decode attention off, gather + SDPA instead: %s (install g++ and "
                    "ninja, or pass --no-cpu-decode-kernel to choose this path)", why)
        return None
    return cpu_paged_decode.paged_decode


def assemble_core(model, mcfg, args: EngineArgs, device: torch.device):
    """Model in hand -> (EngineCore, KVPlan, ModelRunner): KV cache sized by the plan, attention
    workspace, CUDA graphs, scheduler. GPU tests call this with randomly initialised models."""
    from raypaged.model.attention.torch_backend import TorchAttentionBackend
    from raypaged.model.cuda_graphs import CudaGraphDecoder
    from raypaged.model.input_buffers import InputBuffers
    from raypaged.model.kv_cache import allocate_kv_caches
    from raypaged.model.runner import ModelRunner
    from raypaged.model.sampler import Sampler

    dtype = next(model.parameters()).dtype
    if model.backend.name == "triton":  # refuse what its kernels cannot run, before any step
        from raypaged.model.attention.gpu_support import check_triton_kv_dtype
        from raypaged.model.loader import DTYPES
        dtype_name = next(name for name, d in DTYPES.items() if d == dtype)
        check_triton_kv_dtype(torch.cuda.get_device_capability(device), args.kv_dtype,
                              dtype_name)
    elem = allocate_kv_caches(mcfg, 1, args.block_size, dtype, args.kv_dtype,
                              "meta")[0].key.element_size()
    shape = KVShape(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, elem)
    max_len = resolve_max_model_len(args.max_model_len, mcfg.max_model_len)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    plan = plan_kv_cache(shape, args, max_len, free)
    kv_caches = allocate_kv_caches(mcfg, plan.num_blocks, args.block_size, dtype,
                                   args.kv_dtype, device)
    if device.type == "cpu" and model.backend.name == "torch" and args.cpu_decode_kernel:
        model.backend = TorchAttentionBackend(cpu_decode_kernel(mcfg, kv_caches[0], dtype))
    if model.backend.name == "triton":
        # size the split-K workspace for this engine's batch; a fixed split rule (from
        # max_model_len) keeps decode launches identical between graph capture and replay
        from raypaged.model.attention.triton_backend import TritonAttentionBackend
        model.backend = TritonAttentionBackend(max_num_seqs=args.max_num_seqs, max_model_len=max_len)
    buffers = InputBuffers(args.max_num_seqs, args.max_num_batched_tokens, max_len,
                           args.block_size, device)
    graphs = None
    if device.type == "cuda" and not args.enforce_eager and model.backend.name == "triton":
        graphs = CudaGraphDecoder(model, kv_caches, args.max_num_seqs, max_len, buffers)
        if not graphs.capture():
            graphs = None
    decode_threads = args.decode_threads if device.type == "cpu" else None
    runner = ModelRunner(model, kv_caches, buffers, Sampler(args.seed), graphs, decode_threads)
    scheduler = Scheduler(plan.num_blocks, args.block_size, max_len, args.max_num_seqs,
                          args.max_num_batched_tokens, args.enable_prefix_caching,
                          policy_of(args))
    return EngineCore(scheduler, runner, args.async_scheduling), plan, runner
