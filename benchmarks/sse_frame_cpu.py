"""The router's own Python per streamed token, a plain chunk as a Frame vs as dicts, in one process.

serve_cpu.py measures whole processes of `raypaged serve`; on a shared machine its per-token
figures move with the load by more than one optimisation changes. This isolates what the Frame
(sse_stream.py: a plain text chunk spliced into an event made once per request) saves against
building and serialising the chunk's dicts, as every other chunk is: a worker's per-step
outputs arriving in a Generation's queue (as WorkerLink's sink puts them) -> the SSE strings of
the stream (Generation.stream + sse_stream.sse_events, `plain` on or off) -> encoded to bytes,
at `--concurrency` streams. No Ray, HTTP, Starlette or Serve: their per-chunk cost is the same
either way. Every step the consumers are let run until idle, so the router keeps up (one chunk
per step both ways: no coalescing is counted). CPU time of the process, interleaved rounds,
median:

    python benchmarks/sse_frame_cpu.py [--concurrency 1,4,16] [--tokens 256] [--rounds 5]

(It replaced stream_path_cpu.py, which compared the whole fast path with the per-step path
removed on 2026-11-28; stream_path_cpu.json holds that comparison.)
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import os
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import bars_by_concurrency, plot_path, pyplot, table, write  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.outputs import SequenceOutput  # noqa: E402
from raypaged.serve.fleet import READY  # noqa: E402
from raypaged.serve.frontend import COMPLETIONS  # noqa: E402
from raypaged.serve.generation import Generation  # noqa: E402
from raypaged.serve.leg import Leg  # noqa: E402
from raypaged.serve.metrics import RequestMetrics  # noqa: E402
from raypaged.serve.responses import Shapes  # noqa: E402
from raypaged.serve.sse_stream import sse_events  # noqa: E402

PATHS = ("frame", "dicts")


class _Snapshot:
    def worker(self, worker_id):
        return SimpleNamespace(state=READY, stats=None)  # always ready: no failover


class _Dispatcher:
    """What a Generation asks of the dispatcher once its leg is open."""

    def __init__(self):
        self.metrics = RequestMetrics()
        self.fleet = SimpleNamespace(snapshot=_Snapshot)

    def opened(self, worker_id: str, blocks: int = 0, n: int = 1) -> None:
        pass


def _events(path: str, g: Generation, shapes: Shapes):
    chunk = functools.partial(shapes.completion_choice, False)
    head = {"id": g.request_id, "object": COMPLETIONS.chunk_object, "created": int(time.time()),
            "model": "bench-model"}
    return sse_events([g], 1, chunk, head, None, path == "frame", False, False, None, None)


async def _run(path: str, concurrency: int, tokens: int) -> tuple[float, int]:
    """(CPU seconds per streamed token, SSE events sent) of `concurrency` streams of `tokens`
    tokens."""
    d, shapes = _Dispatcher(), Shapes(tokenizer=None)
    gens, legs = [], []
    for i in range(concurrency):
        g = Generation(d, f"cmpl-{i}", [1, 2, 3], SamplingParams(max_tokens=tokens), None, 0.0)
        leg = Leg("worker-0", None, (0,), False)
        g._legs.append(leg)
        gens.append(g)
        legs.append(leg)
    sent, events = [0] * concurrency, [0] * concurrency

    async def consume(i: int) -> None:
        async for event in _events(path, gens[i], shapes):
            sent[i] += len(event.encode())  # StreamingResponse encodes every str chunk
            events[i] += 1

    tasks = [asyncio.create_task(consume(i)) for i in range(concurrency)]
    for _ in range(3):
        await asyncio.sleep(0)
    start = time.process_time()
    for step in range(tokens):
        finish = "length" if step == tokens - 1 else None
        for g, leg in zip(gens, legs):  # one message per step, split per request (WorkerLink)
            g._queue.put_nowait((leg, [SequenceOutput(g.request_id, 0, (42,), " tok",
                                                      finish_reason=finish)]))
        for _ in range(4):  # every consumer sends its chunk before the next step comes
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - start
    assert all(s > 0 for s in sent)
    return cpu / (concurrency * tokens), sum(events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repeats of both paths")
    ap.add_argument("--name", default="sse_frame_cpu")
    args = ap.parse_args()
    rows = []
    for c in args.concurrency:
        asyncio.run(_run("frame", c, 16))  # warm up imports and caches
        runs, sse = {p: [] for p in PATHS}, {p: set() for p in PATHS}
        for _ in range(args.rounds):
            for p in PATHS:
                cpu, events = asyncio.run(_run(p, c, args.tokens))
                runs[p].append(cpu * 1e6)
                sse[p].add(events)
        # the same chunks both ways (one per step each, plus [DONE]): no coalescing counted
        assert sse["frame"] == sse["dicts"] == {c * (args.tokens + 1)}, sse
        for p in PATHS:
            rows.append({"path": p, "concurrency": c, "rounds": args.rounds,
                         "us_per_token": statistics.median(runs[p]),
                         "us_per_token_runs": runs[p], "sse_events": c * (args.tokens + 1)})
        frame, dicts = rows[-2]["us_per_token"], rows[-1]["us_per_token"]
        rows[-2]["vs_dicts"] = frame / dicts
    print(table(rows, ["path", "concurrency", "rounds", "us_per_token", "vs_dicts"]))
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.1f}")
    print(f"wrote {write(args.name, {'args': vars(args), 'load_avg': load, 'rows': rows})}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bars_by_concurrency(ax, rows, "path", "us_per_token",
                            "router CPU µs per streamed token (Generation -> SSE)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot_path(args.name), dpi=80)
        print(f"wrote {plot_path(args.name)}")


if __name__ == "__main__":
    main()
