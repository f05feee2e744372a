"""Serving configuration: one flat, validated set of arguments shared by the CLI and Serve YAML.

`ServeArgs` (pydantic: it meets the outside world) is what `raypaged serve` builds from its flags
and what a Serve config file passes as the application's `args`; `to_config()` turns it into the
frozen dataclasses the components use. Engine settings stay a plain dict of `EngineArgs` fields so
that this module (and the router) never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from raypaged.model.onednn_cache import DEFAULT_CAPACITY
from raypaged.serve.allocator import DEFAULT_ALLOCATOR

# Fields of raypaged.engine.EngineArgs that serving passes through unchanged.
ENGINE_FIELDS = (
    "model", "dtype", "block_size", "kv_memory_mb", "kv_memory_fraction", "kv_context_len",
    "kv_dtype", "enable_prefix_caching", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "attention_backend", "enforce_eager", "onednn_cache_capacity",
)

# Chosen by benchmarks/serve_bench.py (README): deep enough to get past a chat template's shared
# system prompt, shallow enough that requests sharing a few hundred tokens still agree.
DEFAULT_ROUTE_PREFIX_BLOCKS = 4


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix"                          # "prefix" | "round_robin"
    prefix_blocks: int = DEFAULT_ROUTE_PREFIX_BLOCKS  # hash depth (full blocks) used as the key
    load_factor: float = 1.25  # 1 + eps: a worker above this x the mean load passes a request on


@dataclass(frozen=True)
class FleetConfig:
    num_workers: int = 1
    engine: dict = field(default_factory=dict)      # EngineArgs fields (None values left out)
    cpus_per_worker: float | None = None            # None: the cluster's CPUs shared evenly
    num_threads: int | None = None                  # torch threads; None: cpus_per_worker
    gpus_per_worker: float | None = None            # None: 1 when the cluster has GPUs, else 0
    max_queued_per_worker: int = 1024               # requests beyond the running ones
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 5.0
    engine_factory: str | None = None               # "module:function" (tests); None: build_engine
    allocator: str = DEFAULT_ALLOCATOR              # workers' malloc (serve/allocator.py)


@dataclass(frozen=True)
class ServeConfig:
    app_name: str = "raypaged"
    served_model_name: str | None = None            # None: the engine's model name
    api_key: str | None = None
    router_replicas: int = 1
    router_max_ongoing_requests: int = 2048
    max_request_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    snapshot_interval_s: float = 0.25
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)


class ServeArgs(BaseModel):
    """The arguments of a raypaged application (CLI flags and Serve YAML `args`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    app_name: str = Field("raypaged", pattern=r"^[A-Za-z0-9_.-]+$")
    workers: int = Field(1, ge=1)
    cpus_per_worker: float | None = Field(None, gt=0)
    gpus_per_worker: float | None = Field(None, ge=0)
    num_threads: int | None = Field(None, ge=1)
    routing: Literal["prefix", "round_robin"] = "prefix"
    route_prefix_blocks: int = Field(DEFAULT_ROUTE_PREFIX_BLOCKS, ge=1)
    route_load_factor: float = Field(1.25, ge=1)
    router_replicas: int = Field(1, ge=1)
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_queued_requests: int = Field(1024, ge=0)
    worker_allocator: Literal["tcmalloc", "system"] = DEFAULT_ALLOCATOR  # serve/allocator.py
    # engine
    model: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    kv_memory_mb: float | None = None
    kv_memory_fraction: float | None = None
    kv_context_len: int | None = None
    kv_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    attention_backend: str | None = None
    enforce_eager: bool = False
    onednn_cache_capacity: int = Field(DEFAULT_CAPACITY, ge=1)
    # "module:function" called with the engine kwargs instead of raypaged.engine.build_engine:
    # lets tests run the whole application on a fake engine.
    engine_factory: str | None = None

    def to_config(self) -> ServeConfig:
        engine = {k: getattr(self, k) for k in ENGINE_FIELDS if getattr(self, k) is not None}
        return ServeConfig(
            app_name=self.app_name,
            served_model_name=self.served_model_name,
            api_key=self.api_key or None,
            router_replicas=self.router_replicas,
            max_request_bytes=self.max_request_bytes,
            routing=RoutingConfig(self.routing, self.route_prefix_blocks, self.route_load_factor),
            fleet=FleetConfig(num_workers=self.workers, engine=engine,
                              cpus_per_worker=self.cpus_per_worker,
                              num_threads=self.num_threads,
                              gpus_per_worker=self.gpus_per_worker,
                              max_queued_per_worker=self.max_queued_requests,
                              engine_factory=self.engine_factory,
                              allocator=self.worker_allocator),
        )
