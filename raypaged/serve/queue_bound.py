"""QueueBound: a worker's admission, counting every request from the router's submit until it
finishes, in O(1) per request.

The engine's own counters lag: they change only at the next step, so a flood of submits
between two steps would all see the same empty queue. This counts a request the moment the
worker accepts it, with the KV blocks it may grow to (prompt + max_tokens, each of n samples);
the requests of average size that fit in the pool at once can run, the rest are queued:

    fit    = count x num_blocks // blocks      (blocks: what every accepted request may need)
    queued = count - fit

A burst the KV cache can hold is admitted whole, whatever `max_queued`; past it, a request is
refused while `max_queued` (>= 1 of them) are queued, with a Retry-After from the pace at
which this worker has been finishing requests.
"""
from __future__ import annotations

import collections
import math
import time

from raypaged.core.fair_admission import blocks_needed
from raypaged.core.ttft_slo import RETRY_AFTER_MAX_S

PACE_WINDOW = 64  # finishes the pace is measured over


class QueueBound:
    def __init__(self, max_queued: int, num_blocks: int, block_size: int, max_model_len: int):
        self.max_queued = max_queued
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.count = 0     # requests accepted and not finished
        self.blocks = 0    # the KV blocks they may grow to, together
        self._finished_at: collections.deque[float] = collections.deque(maxlen=PACE_WINDOW)

    def need(self, num_prompt_tokens: int, max_tokens: int | None, n: int) -> int:
        """Blocks a request may hold at its longest (no max_tokens: the rest of max_model_len)."""
        return blocks_needed(num_prompt_tokens, max_tokens, n, self.block_size,
                             self.max_model_len)

    def queued(self) -> int:
        return self.count - min(self.count, self.count * self.num_blocks // max(self.blocks, 1))

    def full(self) -> bool:
        queued = self.queued()
        return queued > 0 and queued >= self.max_queued

    def add(self, blocks: int) -> None:
        self.count += 1
        self.blocks += blocks

    def remove(self, blocks: int) -> None:
        self.count -= 1
        self.blocks -= blocks
        self._finished_at.append(time.monotonic())

    def retry_after_s(self) -> int:
        """Seconds until the queue, at the pace requests have been finishing, has room."""
        done = self._finished_at
        if len(done) < 2 or done[-1] <= done[0]:
            return 1
        per_s = (len(done) - 1) / (done[-1] - done[0])
        wait = (self.queued() - self.max_queued + 1) / per_s
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(wait)))
