"""EngineLoop: a synchronous Engine driven by one thread, talked to from asyncio.

The engine is not thread-safe and `step()` blocks for milliseconds to seconds, so exactly one
thread (the step thread) ever touches it. The event loop never waits on a lock: it appends
commands to an inbox, and the step thread runs them between steps:

    asyncio side                      step thread
    call(fn) ──> inbox ──(wake)──>    while alive:
      <── future resolved ───           run every command in the inbox (add_request, abort, ...)
                                        step() if there is work, else sleep until woken
    on_outputs(outputs) <──────────     hand the step's outputs to the event loop
                                        publish engine.stats() (read by stats(), never blocks)

With the engine's output stage (`output_thread`, raypaged/output_stage.py), step() only hands
the step's token ids over, and the stage's thread detokenizes them and posts the outputs to the
event loop itself: the step thread goes straight on to the next step. Engines without one (the
serving tests' fake) return their outputs from step().
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import logging
import sys
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

# The step thread's name in the kernel (/proc/PID/task/TID/comm, top -H, py-spy), inherited by
# the OpenMP threads it starts: benchmarks/serve_cpu.py tells the model's threads from the
# worker's event loops and Ray's threads by it. Python's thread names stay inside Python.
STEP_THREAD_NAME = b"rp-step"


def name_native_thread(name: bytes) -> None:
    """Linux only, at most 15 bytes; elsewhere, or without libc, nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # 15: PR_SET_NAME


class EngineLoop:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list], None], on_crash: Callable[[BaseException], None]):
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs    # called on the event loop with each step's outputs
        self._on_crash = on_crash        # called on the event loop when step() raises
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._alive = True
        self.stats = engine.stats()      # the latest snapshot; replaced, never mutated
        if engine.output_thread:
            engine.start_output_stage(lambda outputs: self._post(self._on_outputs, outputs))
        self._thread = threading.Thread(target=self._run, name="raypaged-step-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run fn(engine) on the step thread between steps; the future gets its result."""
        fut = self._loop.create_future()
        self.call_nowait(fn, fut)
        return fut

    def call_nowait(self, fn: Callable[[Any], Any], fut: asyncio.Future | None = None) -> None:
        """Like call, for commands nobody waits for (aborts from finally blocks)."""
        self._inbox.append((fn, fut))
        self._wake.set()

    def stop(self) -> None:
        self._alive = False
        self._wake.set()
        self._thread.join(timeout=10)
        if self.engine.stage is not None:
            self.engine.stop_output_stage()

    # -- the step thread ---------------------------------------------------------------------
    def _run(self) -> None:
        name_native_thread(STEP_THREAD_NAME)
        while self._alive:
            # Clear before draining: a command queued after the drain sets the event again, so
            # the wait below returns at once instead of sleeping on a non-empty inbox.
            self._wake.clear()
            self._drain_inbox()
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except BaseException as exc:  # noqa: BLE001 - reported to every caller
                    logger.exception("engine.step() failed")
                    self._post(self._on_crash, exc)
                    # The crash handler queues aborts for the failed requests; wait for them
                    # rather than spin on a step that keeps failing.
                    self._wake.wait(timeout=0.5)
                    continue
                self.stats = self.engine.stats()
                if outputs:
                    self._post(self._on_outputs, outputs)
            else:  # idle: _drain_inbox has published the stats
                self._wake.wait(timeout=1.0)

    def _drain_inbox(self) -> None:
        while self._inbox:
            fn, fut = self._inbox.popleft()
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                result, error = None, exc
            if fut is not None:
                self._post(_resolve, fut, result, error)
            elif error is not None:
                logger.warning("engine command failed: %r", error)
        self.stats = self.engine.stats()

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the process is going away
            self._alive = False


def _resolve(fut: asyncio.Future, result, error) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
