"""One batch job: read rows, group them by prefix, send them through the engine pool with bounded
concurrency, append one output line per row.

    input ─> rows (lazily, a window at a time) ─> skip lines already in the output (resume)
          ─> order the window by prefix key ─> at most workers x max_inflight rows in flight
          ─> frontend.completions / chat_completions (the HTTP API's code) ─> output line

A row whose worker is lost is retried by the frontend (once, on another worker); when no worker
can take it (503: all restarting), it waits for one, for up to ROW_WAIT_S. Every row ends in
exactly one line: its response, or its error.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Iterator

from raypaged.batch.engines import EnginePool, fleet_args
from raypaged.batch.grouping import PrefixKeys, group_by_prefix
from raypaged.batch.options import BatchOptions
from raypaged.batch.output import OutputFile, error_line, success_line
from raypaged.batch.progress import BatchSummary, Progress
from raypaged.batch.rows import COMPLETIONS_URL, Row, read_rows
from raypaged.config import EngineArgs
from raypaged.serve.errors import APIError, bad_request

logger = logging.getLogger(__name__)

ROW_WAIT_S = 600.0      # how long a row waits for a restarting engine before it fails
RETRY_DELAY_S = 0.5


class BatchJob:
    def __init__(self, input_path: str | Path, output_path: str | Path,
                 engine: EngineArgs | None = None, options: BatchOptions | None = None):
        self.input_path = Path(input_path)
        self.output_path = Path(output_path)
        self.engine = engine or EngineArgs()
        self.options = options or BatchOptions()
        self.pool: EnginePool | None = None   # set once the engines are up (tests reach in)
        if not self.input_path.is_file():  # before Ray or any engine starts
            raise FileNotFoundError(f"input file {self.input_path} does not exist")

    async def run(self, serve_args=None) -> BatchSummary:
        """`serve_args`: the fleet's arguments when the caller resolved resources (local Ray)."""
        t0 = time.monotonic()
        out = OutputFile(self.output_path)
        try:
            total, skipped = self._check_resume(out.done)
            if out.cut_bytes:
                print(f"raypaged batch: cut a torn last line ({out.cut_bytes} bytes) off "
                      f"{self.output_path}", flush=True)
            if skipped:
                print(f"raypaged batch: resuming, {skipped:,} of {total:,} rows already in "
                      f"{self.output_path}", flush=True)
            self.pool = await EnginePool.start(serve_args or fleet_args(self.engine, self.options))
            try:
                progress = Progress(total, skipped, self.options.progress_interval_s)
                startup_s = time.monotonic() - t0
                await self._run_rows(out, progress)
                summary = progress.finish(startup_s)
            finally:
                await self.pool.stop()
        finally:
            out.close()
        return summary

    # -- input -----------------------------------------------------------------------------
    def _lines(self) -> Iterator[bytes]:
        with open(self.input_path, "rb") as f:
            yield from f

    def _check_resume(self, done: dict[int, str | None]) -> tuple[int, int]:
        """(rows, rows already written); refuses an output written for another input."""
        total = skipped = 0
        for row in read_rows(self._lines()):
            total += 1
            if row.line_no in done:
                skipped += 1
                if done[row.line_no] != row.custom_id:
                    raise ValueError(
                        f"{self.output_path} was written for another input: its line for input "
                        f"line {row.line_no} has custom_id {done[row.line_no]!r}, the input has "
                        f"{row.custom_id!r}; give a new output path")
        if skipped != len(done):
            raise ValueError(f"{self.output_path} answers {len(done) - skipped} lines that "
                             f"{self.input_path} does not have; give a new output path")
        return total, skipped

    # -- rows ------------------------------------------------------------------------------
    async def _run_rows(self, out: OutputFile, progress: Progress) -> None:
        opts = self.options
        slots = asyncio.Semaphore(opts.workers * opts.max_inflight)
        keys = PrefixKeys(self.pool.frontend.tokenizer, self.pool.block_size,
                          opts.group_prefix_blocks)
        todo = (r for r in read_rows(self._lines()) if r.line_no not in out.done)
        try:
            async with asyncio.TaskGroup() as tasks:
                while window := list(itertools.islice(todo, opts.group_window)):
                    if opts.prefix_grouping:  # tokenizing a window takes a while: off the loop
                        row_keys = await asyncio.to_thread(lambda w=window: [keys.key(r) for r in w])
                        window = group_by_prefix(window, row_keys)
                    for row in window:
                        await slots.acquire()
                        tasks.create_task(self._row(row, out, progress, slots))
        except ExceptionGroup as group:  # a row task found the fleet gone: that is the reason
            raise group.exceptions[0] from None

    async def _row(self, row: Row, out: OutputFile, progress: Progress,
                   slots: asyncio.Semaphore) -> None:
        try:
            line, usage = await self._answer(row)
            out.write(line)
            progress.row_done(line["error"] is None, usage)
        finally:
            slots.release()

    async def _answer(self, row: Row) -> tuple[dict, dict | None]:
        if row.error is not None:
            return error_line(row, row.error), None
        if row.body.get("stream") is True:
            return error_line(row, bad_request(
                f"line {row.line_no}: stream is not supported in a batch: remove it or set it "
                "to false", "stream")), None
        frontend = self.pool.frontend
        endpoint = frontend.completions if row.url == COMPLETIONS_URL else frontend.chat_completions
        deadline = time.monotonic() + ROW_WAIT_S
        while True:
            try:
                response = await endpoint(row.body)
            except APIError as exc:
                if exc.status == 503 and time.monotonic() < deadline:
                    self.pool.check_alive()  # FleetFailed ends the job: no engine will come back
                    await asyncio.sleep(RETRY_DELAY_S)
                    continue
                return error_line(row, exc), None
            except Exception as exc:  # noqa: BLE001 - a bug on one row must not end the job
                logger.exception("row at line %d failed", row.line_no)
                return error_line(row, APIError(500, f"line {row.line_no}: internal error: "
                                                     f"{type(exc).__name__}: {exc}")), None
            body = json.loads(response.body)
            return success_line(row, response.status_code, body), body["usage"]
