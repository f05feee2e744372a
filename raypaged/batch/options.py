"""Settings of `raypaged batch`, declared once (raypaged.settings); engine settings are
`raypaged.config.EngineArgs`', and the engine pool's size and resources are `raypaged serve`'s
(`ServeOptions`), reused. `raypaged batch --help` needs neither torch nor ray."""
from __future__ import annotations

from dataclasses import dataclass

from raypaged.serve.config import DEFAULT_ROUTE_PREFIX_BLOCKS, ServeOptions
from raypaged.settings import same_setting, setting, validate

BATCH = "batch"


@dataclass(frozen=True)
class BatchOptions:
    address: str | None = setting(
        None, "Ray cluster to join (default: $RAY_ADDRESS, which `ray job submit` sets; else "
        "start a local Ray bound to 127.0.0.1)", group=BATCH)
    num_cpus: int | None = setting(None, "CPUs of a local Ray (default: all)", group=BATCH, ge=1)
    workers: int = same_setting(ServeOptions, "workers", group=BATCH)
    cpus_per_worker: float | None = same_setting(ServeOptions, "cpus_per_worker", group=BATCH)
    gpus_per_worker: float | None = same_setting(ServeOptions, "gpus_per_worker", group=BATCH)
    max_inflight: int = setting(
        256, "rows in flight per engine actor; reading the input waits beyond that "
        "(backpressure)", group=BATCH, ge=1)
    prefix_grouping: bool = setting(
        True, "order rows by their prompt's prefix block hash within the read-ahead window, and "
        "send each prefix to one engine", group=BATCH)
    group_window: int = setting(1024, "rows read ahead and ordered by prefix", group=BATCH, ge=1)
    # the router's depth (README, serving): a row's prefix key is the key the router routes by
    group_prefix_blocks: int = setting(DEFAULT_ROUTE_PREFIX_BLOCKS,
                                       "prompt blocks hashed into a row's prefix key",
                                       group=BATCH, ge=1)
    progress_interval_s: float = setting(10.0, "seconds between plain progress log lines",
                                         group=BATCH, gt=0)
    # the HTTP API's body limit by default: a line it would refuse (413) is refused here too
    max_line_bytes: int = setting(
        ServeOptions.__dataclass_fields__["max_request_bytes"].default,
        "input lines longer than this are answered with a 413 error line, never read whole",
        group=BATCH, ge=1024)
    fsync_interval_s: float = setting(
        5.0, "seconds between fsyncs of the output: what a machine crash can lose (those rows "
        "are answered again by a re-run)", group=BATCH, gt=0)
    retry_timeout_s: float = setting(
        600.0, "how long a row keeps retrying failures that are not its own (no engine ready, "
        "a lost engine, 5xx); after that it is left out of the output, for a re-run",
        group=BATCH, gt=0)

    def __post_init__(self) -> None:
        validate(self)
