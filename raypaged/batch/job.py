"""One batch job: read the input once, group rows by prefix, send them through the engine pool
with bounded concurrency, append one output line per row.

    input (read once, a window at a time) ─> skip lines the output already answers (same digest)
          ─> order the window by prefix key ─> at most workers x max_inflight rows in flight
          ─> frontend.completions / chat_completions (the HTTP API's code) ─> output line

A row's answer is final, and written, when it is a response or a refusal of the row's own input
(4xx other than 408/429). Anything else - no engine ready (503), an engine lost twice while
serving it (a 503, or the 400 suspected_poison_request), a 5xx, a bug - is not the row's
fault: the row is retried, with backoff, for up to `retry_timeout_s`, then left out of the
output for a re-run. So an output line is never a
failure a re-run could fix, and a resume skips exactly the lines that are final.

An input line the output answers but whose bytes changed since (its digest differs) stops the
job: the rows in flight finish, then it refuses (InputChanged) instead of mixing answers of two
inputs. Memory grows with the input by 4-12 bytes a row at most (AnsweredLines, SeenIds).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import ray

from raypaged.batch.engines import EnginePool, fleet_args
from raypaged.batch.options import BatchOptions
from raypaged.batch.output import OutputFile, OutputWriteFailed, error_line, success_line
from raypaged.batch.progress import BatchSummary, Progress
from raypaged.batch.rows import COMPLETIONS_URL, PrefixKeys, Row, group_by_prefix, read_rows
from raypaged.config import EngineArgs
from raypaged.serve.errors import APIError, bad_request

logger = logging.getLogger(__name__)

RETRY_DELAY_S = 0.5      # first wait before a retry; doubled each time, up to MAX_RETRY_DELAY_S
MAX_RETRY_DELAY_S = 5.0


class InputChanged(ValueError):
    """The output answers input lines that are no longer what they were."""


class BatchJob:
    """Construction checks the files and takes the output's lock (before Ray or any engine
    starts); run() answers the rows and releases it."""

    def __init__(self, input_path: str | Path, output_path: str | Path,
                 engine: EngineArgs | None = None, options: BatchOptions | None = None):
        self.input_path = Path(input_path)
        self.output_path = Path(output_path)
        self.engine = engine or EngineArgs()
        self.options = options or BatchOptions()
        self.pool: EnginePool | None = None   # set once the engines are up (tests reach in)
        # how the engines start: EnginePool.start(serve_args); tests and benchmarks/batch_memory.py
        # give an in-process pool with the same frontend, block_size, check_alive() and stop()
        self.start_pool = EnginePool.start
        if not self.input_path.is_file():
            raise FileNotFoundError(f"input file {self.input_path} " + (
                "is not a regular file" if self.input_path.exists() else "does not exist"))
        try:  # refused now, with the path, rather than as a traceback once the engines are up
            self.input_path.open("rb").close()
        except OSError as e:
            raise ValueError(f"input file {self.input_path} cannot be read: {e.strerror}") from None
        if same_file(self.input_path, self.output_path):
            raise ValueError(f"the output {self.output_path} is the input file "
                             f"{self.input_path}: writing it would destroy the input; give "
                             "another output path")
        try:
            self.out = OutputFile(self.output_path, self.options.fsync_interval_s)
        except OSError as e:  # a parent that is a file, no permission, a full disk ...
            raise cannot_write("output", self.output_path, e) from None
        self._changed: Row | None = None

    async def run(self, serve_args=None) -> BatchSummary:
        """`serve_args`: the fleet's arguments when the caller resolved resources (local Ray)."""
        t0 = time.monotonic()
        out = self.out
        try:
            if out.cut_bytes:
                print(f"raypaged batch: cut a torn last line ({out.cut_bytes} bytes) off "
                      f"{self.output_path}", flush=True)
            if out.answered.count:
                print(f"raypaged batch: resuming, {out.answered.count:,} rows already in "
                      f"{self.output_path}", flush=True)
            self.pool = await self.start_pool(serve_args or fleet_args(self.engine, self.options))
            try:
                progress = Progress(self.input_path.stat().st_size,
                                    self.options.progress_interval_s)
                startup_s = time.monotonic() - t0
                with open(self.input_path, "rb") as f:
                    await self._run_rows(f, progress)
                summary = progress.finish(startup_s)
            finally:
                await self.pool.stop()
        except BaseException:
            # the error on its way out says more than a failed last fsync of the output
            with contextlib.suppress(OutputWriteFailed):
                out.close()
            raise
        out.close()
        self._check_same_input()
        return summary

    def _check_same_input(self) -> None:
        if self._changed is not None:
            n = self._changed.line_no
            raise InputChanged(
                f"input line {n} of {self.input_path} changed since {self.output_path} answered "
                f"it: the output would mix answers of two inputs. The rows before it that were "
                f"in flight are written; restore the input, or give a new output path")
        left = list(itertools.islice(self.out.answered.left(), 4))
        if left:
            count = self.out.answered.count
            raise InputChanged(
                f"{self.output_path} answers {count:,} input lines that {self.input_path} no "
                f"longer has (line {', '.join(map(str, left))}{', ...' if count > 4 else ''}): "
                "the input was edited since; every line it has is answered, but give a new "
                "output path for an output of this input alone")

    # -- rows ------------------------------------------------------------------------------
    def _todo(self, f: BinaryIO, progress: Progress) -> Iterator[Row]:
        """The rows to answer, in input order: lines answered earlier (same digest) skipped;
        stops at a line answered earlier whose bytes changed (self._changed)."""
        for row in read_rows(f, self.options.max_line_bytes):
            same = self.out.answered.take(row.line_no, row.digest)
            progress.row_read(row.end, skipped=same is True)
            if same is None:
                yield row
            elif not same:
                self._changed = row
                return

    async def _run_rows(self, f: BinaryIO, progress: Progress) -> None:
        opts = self.options
        slots = asyncio.Semaphore(opts.workers * opts.max_inflight)
        keys = PrefixKeys(self.pool.frontend.tokenizer, self.pool.block_size,
                          opts.group_prefix_blocks)
        todo = self._todo(f, progress)
        # reading runs past answered lines without awaiting: off the loop, a window at a time
        read = lambda: list(itertools.islice(todo, opts.group_window))  # noqa: E731
        try:
            async with asyncio.TaskGroup() as tasks:
                while window := await asyncio.to_thread(read):
                    if opts.prefix_grouping:  # tokenizing a window takes a while: off the loop
                        row_keys = await asyncio.to_thread(lambda w=window: [keys.key(r) for r in w])
                        window = group_by_prefix(window, row_keys)
                    for row in window:
                        await slots.acquire()
                        tasks.create_task(self._row(row, progress, slots))
        except ExceptionGroup as group:  # a row task found the fleet gone: that is the reason
            raise group.exceptions[0] from None

    async def _row(self, row: Row, progress: Progress, slots: asyncio.Semaphore) -> None:
        try:
            line = await self._answer(row)
            if line is None:  # not its own failure, past retry_timeout_s: for a re-run
                progress.unanswered += 1
                return
            self.out.write(line)
            # an error line's body is {"error": ...}: no usage
            progress.row_done(line["error"] is None, line["response"]["body"].get("usage"))
        finally:
            slots.release()

    async def _answer(self, row: Row) -> dict | None:
        """The output line, or None: no final answer within retry_timeout_s."""
        if row.error is not None:
            return error_line(row, row.error)
        if row.body.get("stream") is True:
            return error_line(row, bad_request(
                f"line {row.line_no}: stream is not supported in a batch: remove it or set it "
                "to false", "stream"))
        frontend = self.pool.frontend
        endpoint = frontend.completions if row.url == COMPLETIONS_URL else frontend.chat_completions
        deadline = time.monotonic() + self.options.retry_timeout_s
        delay = RETRY_DELAY_S
        while True:
            try:
                response = await endpoint(row.body)
            except APIError as exc:
                if (400 <= exc.status < 500 and exc.status not in (408, 429)  # the row's fault
                        and exc.code != "suspected_poison_request"):  # two engines lost
                    return error_line(row, exc)
                reason = f"{exc.status} {exc.message}"
            except Exception as exc:  # noqa: BLE001 - a bug on one row must not end the job
                logger.exception("row at line %d failed", row.line_no)
                reason = f"internal error: {type(exc).__name__}: {exc}"
            else:
                return success_line(row, response.status_code, json.loads(response.body))
            self.pool.check_alive()  # FleetFailed ends the job: no engine will come back
            if time.monotonic() + delay > deadline:
                logger.warning("line %d: no answer after %.0f s of retries (%s): not written, "
                               "a re-run retries it", row.line_no, self.options.retry_timeout_s,
                               reason)
                return None
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_RETRY_DELAY_S)


# `run_batch`: the Python API beside the offline `LLM`, and what `raypaged batch` calls (run_job).
#
# Joins the Ray cluster at `options.address` or $RAY_ADDRESS (set for a `ray job submit` job),
# else starts a local Ray bound to 127.0.0.1 and stops it at the end; a driver that already called
# ray.init() keeps its cluster.


def run_batch(input_path: str | Path, output_path: str | Path, engine: EngineArgs | None = None,
              options: BatchOptions | None = None) -> BatchSummary:
    """Answer every line of `input_path` into `output_path` (resuming what an earlier run wrote).

    Lines refused for their own input are error lines in the output, not exceptions; rows that
    failed for other reasons past retry_timeout_s are left out (`summary.unanswered`; run again
    to answer them). This raises only when the job cannot run: a missing input, an output that is
    the input or that another job holds, an input changed since the output answered it
    (InputChanged), engines that cannot start; or when the output stops taking writes mid-run
    (OutputWriteFailed: the lines written are whole, run again once there is room).
    """
    return run_job(BatchJob(input_path, output_path, engine, options))


def run_job(job: BatchJob, on_ray: Callable[[], object] = lambda: None) -> BatchSummary:
    """Run the job on Ray (`on_ray`: called once Ray is up, before the engines start). On a
    local Ray, the engines' unset resources are filled from this machine."""
    options = job.options
    address = options.address or os.environ.get("RAY_ADDRESS")
    if address and not ray.is_initialized():
        ray.init(address=address, namespace="raypaged-batch")
    local = not ray.is_initialized()  # else the cluster joined, or the driver's own: it stays up
    if local:
        # A new cluster (address="local"), never one some `ray start` left running on this
        # machine; loopback only: a local job needs no port reachable from elsewhere.
        ray.init(address="local", num_cpus=options.num_cpus or os.cpu_count(),
                 include_dashboard=False, namespace="raypaged-batch", _node_ip_address="127.0.0.1")
    try:
        on_ray()
        args = fleet_args(job.engine, options)
        if local:
            import torch

            from raypaged.serve.cli import local_worker_resources
            args = local_worker_resources(args, int(ray.cluster_resources().get("CPU", 1)),
                                          torch.cuda.device_count())
        return asyncio.run(job.run(args))
    finally:
        if local:
            ray.shutdown()


def same_file(a: Path, b: Path) -> bool:
    """The same path (one that may not exist yet), or, by device and inode, the same file by
    a symlink or a hard link."""
    return os.path.realpath(a) == os.path.realpath(b) or (
        a.exists() and b.exists() and os.path.samefile(a, b))


def cannot_write(what: str, path: Path, e: OSError) -> ValueError:
    """The refusal of a path the job cannot write (`e`: what creating it raised)."""
    why = (f"{e.filename} is not a directory" if isinstance(e, FileExistsError)
           else e.strerror + (f" ({e.filename})" if e.filename else ""))
    return ValueError(f"{what} {path} cannot be written: {why}: give a path in a writable "
                      "directory")
