"""Settings of `raypaged batch` alone, declared once (raypaged.settings); engine settings are
`raypaged.config.EngineArgs`'. Stdlib only: `raypaged batch --help` needs neither torch nor ray."""
from __future__ import annotations

from dataclasses import dataclass

from raypaged.settings import setting, validate

BATCH = "batch"

# The prompt blocks hashed into a row's prefix key: the router's default depth (README, serving),
# deep enough to get past a chat template's shared system prompt.
DEFAULT_GROUP_PREFIX_BLOCKS = 4


@dataclass(frozen=True)
class BatchOptions:
    address: str | None = setting(
        None, "Ray cluster to join (default: $RAY_ADDRESS, which `ray job submit` sets; else "
        "start a local Ray bound to 127.0.0.1)", group=BATCH)
    num_cpus: int | None = setting(None, "CPUs of a local Ray (default: all)", group=BATCH, ge=1)
    workers: int = setting(1, "engine actors (one per GPU on a GPU cluster)", group=BATCH, ge=1)
    cpus_per_worker: float | None = setting(
        None, "CPUs per engine actor, and its torch threads (default: on a local Ray, its CPUs / "
        "workers; on a cluster, 1)", group=BATCH, gt=0)
    gpus_per_worker: float | None = setting(
        None, "default: on a local Ray, 1 when this machine has GPUs; on a cluster, 0",
        group=BATCH, ge=0)
    max_inflight: int = setting(
        256, "rows in flight per engine actor; reading the input waits beyond that "
        "(backpressure)", group=BATCH, ge=1)
    prefix_grouping: bool = setting(
        True, "order rows by their prompt's prefix block hash within the read-ahead window, and "
        "send each prefix to one engine", group=BATCH)
    group_window: int = setting(1024, "rows read ahead and ordered by prefix", group=BATCH, ge=1)
    group_prefix_blocks: int = setting(DEFAULT_GROUP_PREFIX_BLOCKS,
                                       "prompt blocks hashed into a row's prefix key",
                                       group=BATCH, ge=1)
    progress_interval_s: float = setting(10.0, "seconds between plain progress log lines",
                                         group=BATCH, gt=0)

    def __post_init__(self) -> None:
        validate(self)
