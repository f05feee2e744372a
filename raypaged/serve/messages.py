"""Everything that crosses the router <-> worker border, in one place.

    router ── Worker.submit(router_id, request_id, ...) ──>  None (accepted) | Rejected
    router <── Worker.outputs(router_id): one message per engine step ──  {request_id: [item]}
               item: SequenceOutput (raypaged/outputs.py) | Lost
    controller ── Worker.health() / stats() ──>  Health / WorkerStats

Frozen, picklable values; nothing here imports Ray or torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from raypaged.config import KVPlan
from raypaged.core.cache_summary import SummaryDelta
from raypaged.core.contracts import EngineStats


@dataclass(frozen=True)
class Rejected:
    """The worker refused a request before admitting it (nothing was allocated)."""

    message: str
    queue_full: bool = False   # True: try another worker / later; False: the request is invalid
    retry_after_s: int = 1     # queue_full: when this worker expects room, from its queue


@dataclass(frozen=True)
class Lost:
    """The worker's engine failed while running this request (the worker lives on): the
    router may carry it on elsewhere. A request that fails by its own input instead ends with
    finish_reason "error" in its SequenceOutput."""

    request_id: str
    message: str


class WorkerUnavailable(Exception):
    """The worker died, is restarting, or its engine failed: the request may go elsewhere.
    `reached`: the request may have got to the worker, so the loss may be its doing (False
    when it surely did not: the link was down before the submit)."""

    def __init__(self, message: str = "", reached: bool = True):
        super().__init__(message)
        self.reached = reached


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    incarnation: str          # new for every process start: the controller sees restarts
    pid: int
    model_name: str
    max_model_len: int
    block_size: int
    budget: KVPlan            # what fits in this worker's KV cache
    engine: EngineStats
    num_active: int           # requests accepted and not finished: the routing load
    graph_steps: int = 0      # model steps replayed from a CUDA graph
    eager_steps: int = 0      # model steps run eagerly
    cache: SummaryDelta | None = None  # prefix-cache changes since the version asked for
    node_id: str = ""         # the Ray node its process runs on ("": not on Ray)


@dataclass(frozen=True)
class Health:
    """The answer to the controller's liveness probe."""

    incarnation: str
    stalled_s: float  # how long the engine has had work but finished no step (0: progressing)
