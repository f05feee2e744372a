"""OutputStage: detokenization and stop strings on their own thread, off the step loop.

The serving step thread hands over each step's RequestDeltas (token ids) and goes straight to
the next step; this thread turns them into SequenceOutputs (text deltas) for `sink`:

    step thread                          output thread
    Engine.add_request ─ ("add", ...) ─>  OutputProcessor.add
    Engine.step / abort ─ deltas ──────>  OutputProcessor.process ──> sink(outputs)
    next Engine.step: core.abort(...) <─  aborts (a stop string completed, a detokenizer error)

One FIFO queue carries both kinds of items, so a request is always tracked before its deltas
arrive. An abort asked for here reaches core at the start of the next step (the one already
running may sample one more token for that sequence; the processor drops it).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Callable

from raypaged.output_processor import OutputProcessor
from raypaged.outputs import SequenceOutput

log = logging.getLogger(__name__)

_STOP = object()


class OutputStage:
    def __init__(self, processor: OutputProcessor, sink: Callable[[list[SequenceOutput]], None]):
        self.processor = processor
        self._sink = sink
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # (sequence id, reason) pairs for core, appended here and taken by the step thread
        # (deque append/popleft are atomic: no lock)
        self.aborts: collections.deque[tuple[str, str]] = collections.deque()
        self._thread = threading.Thread(target=self._run, name="raypaged-output-stage",
                                        daemon=True)
        self._thread.start()

    def add(self, *args) -> None:
        """OutputProcessor.add's arguments, applied in order with the deltas."""
        self._queue.put(("add", args))

    def submit(self, deltas) -> None:
        if deltas:
            self._queue.put(("deltas", deltas))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every item submitted so far is processed and its outputs sunk (a marker
        through the same FIFO queue: nothing is counted per item)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def stop(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():  # one sink call for everything ready: fewer wakeups
                items.append(self._queue.get_nowait())
            outputs: list[SequenceOutput] = []
            drained = []
            for item in items:
                if item is _STOP:
                    return
                if isinstance(item, threading.Event):
                    drained.append(item)
                    continue
                kind, payload = item
                try:
                    if kind == "add":
                        self.processor.add(*payload)
                    else:
                        outs, aborts = self.processor.process(payload)
                        outputs += outs
                        self.aborts.extend(aborts)
                except Exception:  # noqa: BLE001 - a bug here must not silence every stream
                    log.exception("the output stage failed on %s", kind)
            if outputs:
                self._sink(outputs)
            for done in drained:
                done.set()
