"""Progress while the job runs, and the summary at its end.

On a terminal: a live bar (rows, output tok/s, ETA). Always: a plain log line every
`interval_s` seconds, because `ray job logs` is not a terminal.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BatchSummary:
    rows: int                  # non-blank input lines
    skipped: int               # already in the output from an earlier run
    completed: int             # written now with status 200
    failed: int                # written now as error lines
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int         # prompt tokens served from the prefix cache
    wall_s: float              # from the first row sent to the last line written
    startup_s: float = 0.0     # starting Ray and the engines, before that

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
            f"tokens in / out  {self.prompt_tokens:,} / {self.completion_tokens:,}",
            f"output tok/s     {self.output_tokens_per_s:,.1f}",
            f"prefix cache hit {self.prefix_hit_rate:.1%} of prompt tokens "
            f"({self.cached_tokens:,} cached)",
            f"wall time        {self.wall_s:,.1f} s (+ {self.startup_s:,.1f} s starting engines)",
        ])


class Progress:
    def __init__(self, rows: int, skipped: int, interval_s: float, tty: bool | None = None):
        self.rows, self.skipped, self.interval_s = rows, skipped, interval_s
        self.completed = self.failed = 0
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.started = self._last_log = time.monotonic()
        self._bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm
            self._bar = tqdm(total=rows, initial=skipped, unit="row", dynamic_ncols=True)

    def row_done(self, ok: bool, usage: dict | None = None) -> None:
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        if usage:
            self.prompt_tokens += usage["prompt_tokens"]
            self.completion_tokens += usage["completion_tokens"]
            self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
        now = time.monotonic()
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._tok_s(now):,.1f} tok/s, {self.failed} failed",
                                      refresh=False)
            self._bar.update(1)
        if now - self._last_log >= self.interval_s:
            self._last_log = now
            print(self.line(now), flush=True)

    def line(self, now: float) -> str:
        done = self.skipped + self.completed + self.failed
        rate = (self.completed + self.failed) / max(now - self.started, 1e-9)
        eta = (self.rows - done) / rate if rate > 0 else float("inf")
        return (f"raypaged batch: {done:,}/{self.rows:,} rows ({done / max(self.rows, 1):.0%}), "
                f"{self.failed:,} failed, {self._tok_s(now):,.1f} output tok/s, "
                f"ETA {_duration(eta)}")

    def _tok_s(self, now: float) -> float:
        return self.completion_tokens / max(now - self.started, 1e-9)

    def finish(self, startup_s: float) -> BatchSummary:
        if self._bar is not None:
            self._bar.close()
        return BatchSummary(self.rows, self.skipped, self.completed, self.failed,
                            self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                            time.monotonic() - self.started, startup_s)


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
