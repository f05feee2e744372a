"""Progress while the job runs, and the summary at its end.

On a terminal: a live bar (share of the input read, rows, output tok/s, ETA). Always: a plain
log line every `interval_s` seconds, because `ray job logs` is not a terminal. The input is read
once, as the job goes, so the number of rows is known only at the end: until then it is
estimated from the bytes the rows read so far took.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BatchSummary:
    rows: int                  # non-blank input lines read
    skipped: int               # already in the output from an earlier run
    completed: int             # written now with status 200
    failed: int                # written now as error lines (the row's own input was refused)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int         # prompt tokens served from the prefix cache
    wall_s: float              # from the first row sent to the last line written
    startup_s: float = 0.0     # starting Ray and the engines, before that
    unanswered: int = 0        # failed for reasons not their own past retry_timeout_s: not
                               # written, so a re-run answers them

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
                "prefix_hit_rate": self.prefix_hit_rate}

    def report(self) -> str:
        return "\n".join([
            f"rows             {self.rows:,} ({self.skipped:,} done by an earlier run)",
            f"completed        {self.completed:,}",
            f"failed           {self.failed:,}",
            *([f"unanswered       {self.unanswered:,} (not written: re-run to retry them)"]
              if self.unanswered else []),
            f"tokens in / out  {self.prompt_tokens:,} / {self.completion_tokens:,}",
            f"output tok/s     {self.output_tokens_per_s:,.1f}",
            f"prefix cache hit {self.prefix_hit_rate:.1%} of prompt tokens "
            f"({self.cached_tokens:,} cached)",
            f"wall time        {self.wall_s:,.1f} s (+ {self.startup_s:,.1f} s starting engines)",
        ])


class Progress:
    def __init__(self, input_bytes: int, interval_s: float, tty: bool | None = None):
        self.input_bytes, self.interval_s = input_bytes, interval_s
        self.rows = self.skipped = self.completed = self.failed = self.unanswered = 0
        self.read_bytes = self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.started = self._last_log = time.monotonic()
        self._bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm
            self._bar = tqdm(total=input_bytes, unit="B", unit_scale=True, dynamic_ncols=True)

    def row_read(self, end: int, skipped: bool) -> None:
        """A row read from the input (`end`: the byte offset after it), done earlier or not."""
        self.rows += 1
        self.skipped += skipped
        if self._bar is not None:
            self._bar.update(end - self.read_bytes)
        self.read_bytes = end

    def row_done(self, ok: bool, usage: dict | None = None) -> None:
        self.completed += ok
        self.failed += not ok
        if usage:
            self.prompt_tokens += usage["prompt_tokens"]
            self.completion_tokens += usage["completion_tokens"]
            self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
        now = time.monotonic()
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.skipped + self.completed + self.failed:,} rows, "
                                      f"{self._tok_s(now):,.1f} tok/s, {self.failed} failed",
                                      refresh=False)
        if now - self._last_log >= self.interval_s:
            self._last_log = now
            print(self.line(now), flush=True)

    def line(self, now: float) -> str:
        done = self.skipped + self.completed + self.failed
        total = self.rows  # rows in the input: estimated from the bytes the rows read so far took
        if self.read_bytes:
            total = max(total, round(self.rows * self.input_bytes / self.read_bytes))
        rate = (self.completed + self.failed) / max(now - self.started, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        return (f"raypaged batch: {done:,} rows done of ~{total:,}, {self.failed:,} failed, "
                f"{self._tok_s(now):,.1f} output tok/s, ETA {_duration(eta)}")

    def _tok_s(self, now: float) -> float:
        return self.completion_tokens / max(now - self.started, 1e-9)

    def finish(self, startup_s: float) -> BatchSummary:
        if self._bar is not None:
            self._bar.close()
        return BatchSummary(self.rows, self.skipped, self.completed, self.failed,
                            self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                            time.monotonic() - self.started, startup_s, self.unanswered)


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
